"""LoRAExpertsLinear: an MoE layer's stacked experts linear plus the batch's adapters, each row (a token's pick of one
expert) with its own request's adapter and its own expert's A and B.

The pool holds an experts' linear with one row per (slot, expert): read as slot * experts + expert, a "virtual slot"
is one ordinary slot to the backends, so every backend's segmented shrink/expand (torch, CPU kernels, Triton) runs
unchanged. The MoE block sorts its rows by expert, tokens in batch order within an expert (worker/layers/moe.py), and
a batch's tokens come in runs of one slot (its segments): so the rows form runs of one (expert, slot), which are this
linear's segments. They are computed once per MoE layer and forward, on the host (the block already brought the
routing there), and shared by the layer's gate_up and down wrappers through Routing.extras."""

from __future__ import annotations

import torch
from loraplex.kernels import LoRABatchMeta
from loraplex.worker.layers.moe import Routing
from loraplex.worker.lora.layers import LoRABatchInfo, LoRALinear


class LoRAExpertsLinear(LoRALinear):
    def forward(self, rows: torch.Tensor, routing: Routing) -> torch.Tensor:
        y = self.base.partial(rows, routing)  # (rows, out_per_rank): before any reduction (the block reduces)
        batch = self.batch
        if self.fused_name in batch.active:
            meta = routing.extras.get("lora_meta")
            if meta is None:
                meta = routing.extras["lora_meta"] = expert_segments(routing, batch)
            if meta is not None:  # None: no row of an adapter's token
                batch.backend.shrink_expand(y, rows.contiguous(), self.buffers, meta)
        return self.base.finish(y)


def expert_segments(routing: Routing, batch: LoRABatchInfo) -> LoRABatchMeta | None:
    """The rows' runs of one (expert, slot) as segments of virtual slots slot * experts + expert (-1: base rows)."""
    seg_indptr, seg_slots = batch.host_segments
    token_slots = torch.repeat_interleave(
        torch.tensor(seg_slots, dtype=torch.int64), torch.tensor(seg_indptr, dtype=torch.int64).diff()
    )  # (tokens,)
    num_experts = routing.num_experts
    counts = torch.tensor(routing.expert_bounds, dtype=torch.int64).diff()
    row_experts = torch.repeat_interleave(torch.arange(num_experts), counts)  # (rows,)
    row_slots = token_slots[torch.tensor(routing.host_token_ids, dtype=torch.int64)]  # (rows,)
    virtual = torch.where(row_slots >= 0, row_slots * num_experts + row_experts, -1)
    if not bool((virtual >= 0).any()):
        return None
    starts = torch.ones_like(virtual, dtype=torch.bool)
    starts[1:] = virtual[1:] != virtual[:-1]
    first_rows = starts.nonzero().flatten()
    token_scales = batch.host_row_scales
    row_scales = None if token_scales is None else [token_scales[token] for token in routing.host_token_ids]
    return batch.backend.prepare([*first_rows.tolist(), virtual.shape[0]], virtual[first_rows].tolist(), row_scales)
