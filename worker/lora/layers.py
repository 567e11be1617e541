"""LoRALinear: a base linear plus the batch's adapters: y = base(x) + scale · (x · Aᵀ) · Bᵀ, A and B of each row's slot.

It replaces a linear on the built model (model code never sees it) and exposes the same attributes, so the model
reads e.g. `qkv_proj.output_sizes_per_rank` as before. All wrappers share one LoRABatchInfo, set once per forward."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kernels import lora_expand, lora_shrink, lora_shrink_expand
from worker.lora.pool import LoRABuffers
from worker.parallel import all_reduce

# What linear.py's layers promise a wrapper, re-exported for the model code.
_LINEAR_ATTRS = (
    "tp_mode",
    "tp_rank",
    "tp_size",
    "input_size",
    "input_size_per_rank",
    "output_sizes",
    "output_sizes_per_rank",
    "output_offsets_per_rank",
    "num_slices",
)


@dataclass
class LoRABatchInfo:
    """The tokens of the current forward grouped into segments of consecutive rows with one slot."""

    seg_indptr: torch.Tensor | None = None  # (segments + 1,) int32: segment i is rows seg_indptr[i] ... [i + 1]
    seg_slots: torch.Tensor | None = None  # (segments,) int32: its slot, -1 = base model (the kernels skip it)
    # Fused linears (FusedLinear.name) that some segment's adapter targets; the others skip LoRA entirely,
    # so a base-only batch costs one set lookup per linear. Decided on the host: identical on every TP rank.
    active: frozenset[str] = field(default_factory=frozenset)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, buffers: LoRABuffers, batch: LoRABatchInfo):
        super().__init__()
        self.base = base
        self.buffers = buffers
        self.batch = batch
        self.fused_name = buffers.fused.name
        for name in _LINEAR_ATTRS:
            setattr(self, name, getattr(base, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # (tokens, out_per_rank)
        batch = self.batch
        if self.fused_name not in batch.active:
            return y
        buffers = self.buffers
        if x.stride(-1) != 1:
            x = x.contiguous()
        if self.tp_mode == "column" or self.tp_size == 1:  # nothing to reduce between shrink and expand
            lora_shrink_expand(
                y,
                x,
                buffers.lora_a,
                buffers.lora_b,
                batch.seg_indptr,
                batch.seg_slots,
                buffers.slot_ranks,
                buffers.slot_scales,
                buffers.slice_offsets,
            )
            return y
        # Row-parallel under TP: x holds this rank's input columns, so h (tokens, max_rank) is a partial sum to reduce
        # before the expand; B is whole on every rank.
        h = lora_shrink(x, buffers.lora_a, batch.seg_indptr, batch.seg_slots, buffers.slot_ranks, buffers.num_slices)
        h = all_reduce(h, self.tp_size)
        lora_expand(
            y,
            h,
            buffers.lora_b,
            batch.seg_indptr,
            batch.seg_slots,
            buffers.slot_ranks,
            buffers.slot_scales,
            buffers.slice_offsets,
        )
        return y

    def extra_repr(self) -> str:
        return f"slots={self.buffers.lora_a.shape[0]}, max_rank={self.buffers.max_rank}"
