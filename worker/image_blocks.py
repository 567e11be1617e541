"""Image tokens that attend both ways (Gemma 4 with use_bidirectional_attention "vision"): on the sliding-window
layers, a token of an image's placeholder run also sees the run's later tokens (transformers: the sliding mask is
window AND (causal OR same image); full layers stay causal).

The pass attends causally as usual (its backend writes the keys and values to the cache); then each image run's
query rows are attended again over the cache, from the window's start to the run's end. So a run's tokens must all
be in the cache by the end of the pass that takes its last ones: the scheduler keeps a run whole within a pass
(`WorkerReady.images_whole`, scheduler/image_runs.py, as for Gemma 3), and a prefix hit may end inside one (its
earlier tokens' cached keys were computed over the whole run: the hit is keyed by the image). A pass that cuts a run
before its end is refused.

Gemma 3's images attend both ways too, but on every layer: there the mask is built where the scores are
(worker/layers/attention.py, SDPAAttention.image_blocks / image_block_mask; the triton backend's image passes run
torch's SDPA). Gemma 4 re-attends here instead because only its sliding layers see a run both ways and its passes
keep any backend (Triton over the strided cache views, KV-shared layers) for the causal part."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from loraplex.protocol.structs import ForwardReq
from loraplex.worker.batch_inputs import BatchError


@dataclass(frozen=True)
class ImageBlock:
    q_rows: torch.Tensor  # (queries,) the run's rows in the pass's flat token batch
    q_pos: torch.Tensor  # (queries,) their positions
    kv_slots: torch.Tensor  # (keys,) cache slots of the positions from the window's start to the run's end
    kv_pos: torch.Tensor  # (keys,)


def image_blocks(reqs: list[ForwardReq], page_size: int, window: int, device: torch.device) -> list[ImageBlock]:
    """The pass's image runs (those whose last token it takes), each with the keys its queries see."""
    blocks: list[ImageBlock] = []
    first_row = 0
    for i, req in enumerate(reqs):
        start, end = req.num_cached_tokens, req.num_cached_tokens + len(req.input_ids)
        for image in req.images:
            lo, hi = max(image.offset, start), image.offset + image.num_tokens
            if lo >= min(hi, end):
                continue
            if hi > end:
                raise BatchError(f"request {i}: the pass ends inside the image run at {image.offset}, whose tokens "
                                 "attend both ways: a run must end within one pass")  # fmt: skip
            kv_pos = torch.arange(max(0, lo - window + 1), hi)
            pages = torch.tensor(req.page_ids, dtype=torch.long)
            kv_slots = pages[kv_pos // page_size] * page_size + kv_pos % page_size
            q_pos = torch.arange(lo, hi)
            blocks.append(ImageBlock(q_rows=(first_row + q_pos - start).to(device), q_pos=q_pos.to(device),
                                     kv_slots=kv_slots.to(device), kv_pos=kv_pos.to(device)))  # fmt: skip
        first_row += len(req.input_ids)
    return blocks


def attend_image_blocks(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        blocks: list[ImageBlock], window: int, scale: float) -> torch.Tensor:  # fmt: skip
    """out (tokens, heads, head_dim) with each block's query rows attended again over the cache (keys inside the
    window, the run's later ones included); q (tokens, heads, head_dim) rotated; caches (slots, kv_heads, dim)."""
    out = out.clone()
    for block in blocks:
        qs = q[block.q_rows].transpose(0, 1)  # (heads, queries, dim)
        ks, vs = (cache[block.kv_slots].to(q.dtype).transpose(0, 1) for cache in (k_cache, v_cache))
        groups = qs.shape[0] // ks.shape[0]
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        visible = block.kv_pos[None, :] > block.q_pos[:, None] - window  # (queries, keys)
        attended = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible, scale=scale)
        out[block.q_rows] = attended.transpose(0, 1).to(out.dtype)
    return out
