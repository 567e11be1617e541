"""LoRALatentKVProj: latent attention's kv_b_proj plus the batch's adapters, in the absorbed form the model applies it.

kv_b_proj is never applied to tokens: its k half W_uk is folded into the query and its v half W_uv maps the
attention's latent output (worker/model/deepseek_v3.py). An adapter replaces W by W + s·B·A (A (r, kv_lora_rank),
B (heads * (qk_nope + v), r), per head B_k (qk_nope, r) and B_v (v, r)), so for the rows of a request on that adapter
    absorb_query:  (W_uk + s·B_k·A)ᵀ q_nope = W_ukᵀ q_nope + s · Aᵀ (B_kᵀ q_nope)
    expand_values: (W_uv + s·B_v·A) o       = W_uv o       + s · B_v (A o)
exact, with every cached key of the request expanded by its own adapter as the reference expands it: a request's
cached latents were all written under its adapter (the prefix cache is keyed by adapter), and the query's adapter is
the one applied to them. The terms are computed per segment of one slot (few per batch), in torch."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from loraplex.worker.lora.layers import LoRALinear


class LoRALatentKVProj(LoRALinear):
    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        out = self.base.absorb_query(q_nope)  # (tokens, heads, kv_lora_rank)
        for rows, lora_a, b_k, _, scale in self._segments():
            h = torch.einsum("thn,hnr->thr", q_nope[rows], b_k)  # (seg_tokens, heads, r)
            out[rows] += scale * (h @ lora_a)
        return out

    def expand_values(self, latent_out: torch.Tensor) -> torch.Tensor:
        out = self.base.expand_values(latent_out)  # (tokens, heads, v)
        for rows, lora_a, _, b_v, scale in self._segments():
            h = latent_out[rows] @ lora_a.T  # (seg_tokens, heads, r)
            out[rows] += scale * torch.einsum("thr,hvr->thv", h, b_v)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError("kv_b_proj is applied in the absorbed form: absorb_query and expand_values")

    def _segments(self) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor, float]]:
        """Each segment on an adapter that targets kv_b_proj: (its token rows, A (r_max, kv_lora_rank), B_k (heads,
        qk_nope, r_max), B_v (heads, v, r_max), scale); past an adapter's rank A and B are zero."""
        batch, buffers = self.batch, self.buffers
        if self.fused_name not in batch.active:
            return
        seg_indptr, seg_slots = batch.host_segments
        nope = self.base.qk_nope_head_dim
        for start, end, slot in zip(seg_indptr[:-1], seg_indptr[1:], seg_slots, strict=True):
            if slot < 0 or not buffers.host_ranks[slot]:
                continue
            lora_b = buffers.lora_b[slot].T.reshape(-1, nope + self.base.v_head_dim, buffers.max_rank)
            yield (slice(start, end), buffers.lora_a[slot], lora_b[:, :nope], lora_b[:, nope:],
                   buffers.host_scales[slot])  # fmt: skip
