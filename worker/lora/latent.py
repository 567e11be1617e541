"""LoRALatentKVProj: latent attention's kv_b_proj plus the batch's adapters, in both forms the model applies it.

kv_b_proj (W, (heads * (qk_nope + v), kv_lora_rank)) maps a latent c to each head's [k_nope | v]
(worker/model/deepseek_v3.py). An adapter replaces W by W + s·B·A (A (r, kv_lora_rank), B (heads * (qk_nope + v), r),
per head B_k (qk_nope, r) and B_v (v, r)). For the rows of a request on that adapter:
    expand (prefills, on the gathered context):  (W + s·B·A) c            = W c            + s · B (A c)
    absorb_query (decodes):                      (W_uk + s·B_k·A)ᵀ q_nope = W_ukᵀ q_nope + s · Aᵀ (B_kᵀ q_nope)
    expand_values (decodes):                     (W_uv + s·B_v·A) o       = W_uv o       + s · B_v (A o)
exact, with every cached key of the request expanded by its own adapter as the reference expands it: a request's
cached latents were all written under its adapter (the prefix cache is keyed by adapter), and the query's adapter is
the one applied to them.

The rows these take are not the batch's own (a part of its requests, or their gathered context), so each call comes
with the rows' RowOwners (worker/layers/attention.py): runs of rows, each a request's, named by the request's first
row in the batch, whose segment gives the adapter slot. The runs of one slot are derived once per forward and kept in
the owners' extras; the terms are computed per run of one slot (few per batch), in torch."""

from __future__ import annotations

import bisect
from collections.abc import Iterator

import torch
from loraplex.worker.layers.attention import RowOwners
from loraplex.worker.lora.layers import LoRABatchInfo, LoRALinear


class LoRALatentKVProj(LoRALinear):
    def expand(self, latents: torch.Tensor, owners: RowOwners) -> torch.Tensor:
        out = self.base.expand(latents, owners)  # (rows, heads, qk_nope + v)
        flat = out.view(out.shape[0], -1)  # (rows, heads * (qk_nope + v))
        for rows, slot, scale in self._runs(owners):
            h = latents[rows] @ self.buffers.lora_a[slot].T  # (run_rows, r)
            flat[rows] += scale * (h @ self.buffers.lora_b[slot])
        return out

    def absorb_query(self, q_nope: torch.Tensor, owners: RowOwners) -> torch.Tensor:
        out = self.base.absorb_query(q_nope, owners)  # (rows, heads, kv_lora_rank)
        for rows, slot, scale in self._runs(owners):
            b_k, _ = self._head_b(slot)
            h = torch.einsum("thn,hnr->thr", q_nope[rows], b_k)  # (run_rows, heads, r)
            out[rows] += scale * (h @ self.buffers.lora_a[slot])
        return out

    def expand_values(self, latent_out: torch.Tensor, owners: RowOwners) -> torch.Tensor:
        out = self.base.expand_values(latent_out, owners)  # (rows, heads, v)
        for rows, slot, scale in self._runs(owners):
            _, b_v = self._head_b(slot)
            h = latent_out[rows] @ self.buffers.lora_a[slot].T  # (run_rows, heads, r)
            out[rows] += scale * torch.einsum("thr,hvr->thv", h, b_v)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError("kv_b_proj is applied to gathered latents or in the absorbed form, with their rows' owners")

    def _head_b(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """B of `slot` per head: B_k (heads, qk_nope, r_max), B_v (heads, v, r_max); past the rank, zero."""
        nope, buffers = self.base.qk_nope_head_dim, self.buffers
        lora_b = buffers.lora_b[slot].T.reshape(-1, nope + self.base.v_head_dim, buffers.max_rank)
        return lora_b[:, :nope], lora_b[:, nope:]

    def _runs(self, owners: RowOwners) -> Iterator[tuple[slice, int, float]]:
        """Each run of rows on an adapter that targets kv_b_proj: (its rows, its slot, scale)."""
        if self.fused_name not in self.batch.active:
            return
        runs = owners.extras.get("lora_runs")
        if runs is None:
            runs = owners.extras["lora_runs"] = slot_runs(owners, self.batch)
        buffers = self.buffers
        for start, end, slot, row_scale in runs:
            if buffers.host_ranks[slot]:
                yield slice(start, end), slot, buffers.host_scales[slot] * row_scale


def slot_runs(owners: RowOwners, batch: LoRABatchInfo) -> list[tuple[int, int, int, float]]:
    """The owners' rows as runs of one adapter slot and request strength, (start, end, slot, strength), base rows
    left out."""
    seg_indptr, seg_slots = batch.host_segments
    row_scales = batch.host_row_scales
    runs: list[tuple[int, int, int, float]] = []
    for start, end, owner in zip(owners.run_starts[:-1], owners.run_starts[1:], owners.owner_rows, strict=True):
        slot = seg_slots[bisect.bisect_right(seg_indptr, owner) - 1]  # the segment holding the owner's row
        if slot < 0 or start == end:
            continue
        row_scale = 1.0 if row_scales is None else row_scales[owner]
        if runs and runs[-1][1] == start and runs[-1][2:] == (slot, row_scale):
            runs[-1] = (runs[-1][0], end, slot, row_scale)
        else:
            runs.append((start, end, slot, row_scale))
    return runs
