"""Eagle3Runner: speculative decoding's EAGLE-3 head (worker/model/eagle3.py) beside the target, its one-layer KV cache
on the target's pages (as DraftRunner's), drafting from the target's own hidden states. An adapter may have a head of
its own (--speculative-lora-modules NAME=HEAD_DIR); a request always runs on the same head (its adapter's, else the
base head), so the heads share one KV cache.

The head's position p reads the token at p + 1 and the target's feature at p, so it can only run over a position once
the next token is known. Each pass therefore runs in two halves:
- before the target (propose): the head catches up over the positions the previous pass verified (their features were
  kept then), the last of them reading this pass's first token; a decoding request that asks for k drafts then takes
  them greedily from the last position's output, feeding each step's pre-norm output back as the next feature.
- after the target (record): forward hooks on three target layers caught every row's hidden states; the rows of the
  tokens the pass kept (its non-draft tokens and the accepted drafts) are projected by the head's fc and kept per
  request (req_key) with their tokens, for the next pass's catch-up.
Features are only kept for the position the next pass starts at: after a preemption (recompute) or on a prefix hit
the head starts from what the pass itself gives, and a drafting request with nothing to catch up from drafts nothing
that pass. The drafts are only guesses: the target's verification alone decides every output token.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import msgspec
import torch
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import ForwardReq
from loraplex.worker.batch_inputs import BatchInputs
from loraplex.worker.kv_cache import KVCache
from loraplex.worker.layers.attention import select_attention_backend
from loraplex.worker.layers.ops import model_ops, select_model_ops
from loraplex.worker.loader import load_weights
from loraplex.worker.model.config import ModelConfig, ModelConfigError
from loraplex.worker.model.eagle3 import Eagle3Config, Eagle3Head
from torch import nn

logger = logging.getLogger(__name__)

# the targets whose decoder layers return (MLP output, residual stream before it), as the hooks read them
TARGET_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class _Kept:
    start: int  # the position of the first kept feature
    features: torch.Tensor  # (rows, hidden): fc of the target's hidden states at start, start + 1, ...
    next_tokens: list[int]  # the tokens at start + 1 ... (rows - 1 of them; the last row's comes with the next pass)


class Eagle3Runner:
    reads_target_hidden = True  # the target's decode steps run eagerly (its hooks do not run in a CUDA graph)

    def __init__(self, config: ServerConfig, head_dir: str, target: nn.Module, target_config: ModelConfig, *,
                 num_pages: int, page_size: int, context_length: int, device: torch.device, dtype: torch.dtype,
                 cpu_kernels) -> None:  # fmt: skip
        if target_config.model_type not in TARGET_TYPES:
            raise ModelConfigError(f"EAGLE-3 drafts from the hidden states of a Llama-family decoder "
                                   f"({', '.join(TARGET_TYPES)}), not {target_config.model_type}'s")  # fmt: skip
        self.device, self.page_size, self.context_length = device, page_size, context_length
        # None: the head of every request whose adapter has none of its own (--speculative-lora-modules NAME=HEAD)
        dirs = {None: head_dir, **{s.lora_name: s.lora_path for s in config.draft_lora_sources}}
        self.heads = {name: self._load_head(path, target_config, context_length, device, dtype, cpu_kernels)
                      for name, path in dirs.items()}  # fmt: skip
        hc = self.heads[None].config
        if any((h.config.model.num_heads, h.config.model.num_kv_heads, h.config.model.head_dim)
               != (hc.model.num_heads, hc.model.num_kv_heads, hc.model.head_dim) for h in self.heads.values()):
            raise ModelConfigError("EAGLE-3 heads for adapters share one KV cache: they need the base head's "
                                   "attention heads and head size")  # fmt: skip
        self._pass_heads: list[str | None] = []  # the head of each request of the pass running
        embedding = target.model.embed_tokens
        while not hasattr(embedding, "weight"):  # under LoRA's wrappers: the base embedding
            embedding = embedding.base
        self.target_embedding = embedding.weight  # read where the head has no embedding of its own
        mc = hc.model
        self.attention = select_attention_backend(config.attention_backend, device, mc.num_heads, mc.num_kv_heads,
                                                  mc.head_dim, cpu_kernels)  # fmt: skip
        self.kv_cache = KVCache(num_layers=1, num_pages=num_pages, page_size=page_size, num_kv_heads=mc.num_kv_heads,
                                head_dim=mc.head_dim, dtype=dtype, device=device)  # fmt: skip
        self.kept: dict[int, _Kept] = {}  # req_key -> the features the next pass catches up over
        self._captured: dict[int, torch.Tensor] = {}  # target layer -> (tokens, hidden) of the pass running
        for layer_id in sorted({i for head in self.heads.values() for i in head.config.aux_layer_ids}):
            target.model.layers[layer_id].register_forward_hook(self._capture_hook(layer_id))
        for name, path in dirs.items():
            logger.info("EAGLE-3 head %s%s: draft vocabulary %d, reading target layers %s", path,
                        "" if name is None else f" (adapter {name})", self.heads[name].config.draft_vocab_size,
                        list(self.heads[name].config.aux_layer_ids))  # fmt: skip
        logger.info("EAGLE-3 KV cache: %d pages of %d", num_pages, page_size)

    @staticmethod
    def _load_head(head_dir: str, target_config: ModelConfig, max_positions: int, device: torch.device,
                   dtype: torch.dtype, cpu_kernels) -> Eagle3Head:  # fmt: skip
        config = Eagle3Config.from_dir(head_dir, target_config)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with model_ops(select_model_ops(device, cpu_kernels)), device:  # whole on every rank, like a draft model
                head = Eagle3Head(config, max_positions=max_positions)
        finally:
            torch.set_default_dtype(previous)
        load_weights(head, head_dir, show_progress=False)
        return head.eval()

    def _capture_hook(self, layer_id: int):
        def hook(module: nn.Module, args, output) -> None:
            # a decoder layer returns (its MLP output, the stream before it): the stream after it is their sum
            hidden, residual = output
            self._captured[layer_id] = hidden if residual is None else hidden + residual

        return hook

    def release(self, req_keys: list[int]) -> None:
        for key in req_keys:
            self.kept.pop(key, None)

    # ---- before the target ----------------------------------------------------------------------------

    def _run(self, head: Eagle3Head, reqs: list[ForwardReq],
             features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The head over the requests' tokens (their positions from num_cached_tokens): (normed, pre-norm) at each
        request's last token, (reqs, hidden) each."""
        inputs = BatchInputs.build(reqs, self.page_size, self.kv_cache.num_pages, self.context_length, self.device,
                                   self.attention)  # fmt: skip
        normed, prenorm = head(inputs.input_ids, inputs.positions, features, self.target_embedding,
                               self.kv_cache.layer(0), inputs.attention)  # fmt: skip
        return normed[inputs.last_token_index], prenorm[inputs.last_token_index]

    def propose(self, reqs: list[ForwardReq], adapter_names: list[str | None]) -> list[ForwardReq]:
        """The pass's requests, each asking for num_model_drafts tokens now carrying its drafts (none where the head
        has nothing to draft from); the heads' cache caught up to each request's first new token. Each request runs
        on its adapter's head where one was given (adapter_names: its target adapter's), else on the base head; its
        features come from the target on its own adapter either way."""
        self._captured = {}  # the coming target forward's alone
        self._pass_heads = [name if name in self.heads else None for name in adapter_names]
        drafts: dict[int, list[int]] = {}
        for name, head in self.heads.items():
            rows = [i for i, req in enumerate(reqs) if self._pass_heads[i] == name and self._catches_up(req)]
            drafts.update(self._catch_up_and_draft(head, reqs, rows))
        return [msgspec.structs.replace(req, input_ids=req.input_ids + drafts.get(i, []),
                                        num_draft_tokens=len(drafts.get(i, [])), num_model_drafts=0)
                if req.num_model_drafts else req for i, req in enumerate(reqs)]  # fmt: skip

    def _catch_up_and_draft(self, head: Eagle3Head, reqs: list[ForwardReq], rows: list[int]) -> dict[int, list[int]]:
        """One head's requests reqs[rows]: caught up over their kept features, and the drafts of those that ask."""
        drafts: dict[int, list[int]] = {}
        if rows:
            kept = [self.kept[reqs[i].req_key] for i in rows]
            catch_up = [ForwardReq(input_ids=[*k.next_tokens, reqs[i].input_ids[0]], num_cached_tokens=k.start,
                                   page_ids=reqs[i].page_ids) for i, k in zip(rows, kept, strict=True)]  # fmt: skip
            normed, prenorm = self._run(head, catch_up, torch.cat([k.features for k in kept]))
            # a decoding request (one new token) drafts from its last caught-up position, which predicts the token
            # after its new one
            drafting = [j for j, i in enumerate(rows) if reqs[i].num_model_drafts and len(reqs[i].input_ids) == 1]
            if drafting:
                drafts = self._draft(head, reqs, [rows[j] for j in drafting], normed[drafting], prenorm[drafting])
        return drafts

    def _catches_up(self, req: ForwardReq) -> bool:
        kept = self.kept.get(req.req_key)
        return kept is not None and kept.start + len(kept.features) == req.num_cached_tokens and bool(req.input_ids)

    def _draft(self, head: Eagle3Head, reqs: list[ForwardReq], rows: list[int], normed: torch.Tensor,
               prenorm: torch.Tensor) -> dict[int, list[int]]:  # fmt: skip
        """Greedy drafts for reqs[rows] from the head's outputs at their last caught-up positions; step j writes the
        head's KV at the request's new token's position + j - 1 (pages cover its drafts)."""
        drafts = {i: [t] for i, t in zip(rows, head.draft_tokens(normed).tolist(), strict=True)}
        features = dict(zip(rows, prenorm, strict=True))
        for j in range(1, max(reqs[i].num_model_drafts for i in rows)):
            live = [i for i in rows if j < reqs[i].num_model_drafts]
            steps = [ForwardReq(input_ids=[drafts[i][-1]], page_ids=reqs[i].page_ids,
                                num_cached_tokens=reqs[i].num_cached_tokens + j - 1) for i in live]  # fmt: skip
            normed, prenorm = self._run(head, steps, torch.stack([features[i] for i in live]))
            for i, token, feature in zip(live, head.draft_tokens(normed).tolist(), prenorm, strict=True):
                drafts[i].append(token)
                features[i] = feature
        return drafts

    # ---- after the target -----------------------------------------------------------------------------

    def record(self, reqs: list[ForwardReq], accepted_ids: list[list[int]]) -> None:
        """Keep, per request, the head's features of the tokens this pass kept (from the hidden states its target
        forward caught), for the next pass's catch-up."""
        captured, self._captured = self._captured, {}
        if not captured:  # no target forward ran over the hidden states (a pass of no requests)
            return
        starts = [0, *itertools.accumulate(len(req.input_ids) for req in reqs)]
        for name, head in self.heads.items():
            keep: list[tuple[int, ForwardReq, int]] = []  # (first row, request, rows kept) of this head's requests
            for i, req in enumerate(reqs):
                if req.req_key >= 0 and self._pass_heads[i] == name:
                    num_accepted = len(accepted_ids[i]) if accepted_ids else 0
                    keep.append((starts[i], req, len(req.input_ids) - req.num_draft_tokens + num_accepted))
            if not keep:
                continue
            index = torch.tensor([first + r for first, _, n in keep for r in range(n)], device=self.device)
            aux = torch.cat([captured[i][index] for i in head.config.aux_layer_ids], dim=-1)  # (rows, 3 x hidden)
            for (_, req, n), rows in zip(keep, head.features(aux).split([n for _, _, n in keep]), strict=True):
                self.kept[req.req_key] = _Kept(start=req.num_cached_tokens, features=rows,
                                               next_tokens=req.input_ids[1:n])  # fmt: skip
