"""LoRALinear: a base linear plus the batch's adapters: y = base(x) + scale · (x · Aᵀ) · Bᵀ, A and B of each row's slot
(a DoRA adapter's rows then rescaled per output: worker/lora/dora.py).

It replaces a linear on the built model (model code never sees it) and exposes the same attributes, so the model
reads e.g. `qkv_proj.output_sizes_per_rank` as before. All wrappers share one LoRABatchInfo, set once per forward,
and do their products through the worker's one LoRA backend (kernels/backend.py), chosen at start-up."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from loraplex.kernels import LoRABackend, LoRABatchMeta
from loraplex.worker.lora.pool import LoRABuffers
from loraplex.worker.lora.vocab import VocabLoRABuffers
from torch import nn

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

    backend: LoRABackend  # the worker's, chosen at start-up
    meta: LoRABatchMeta | None = None  # the segments on the device and the backend's plan (None: no adapter rows)
    # Fused linears (FusedLinear.name) that some segment's adapter targets; the others skip LoRA entirely,
    # so a base-only batch costs one set lookup per linear. Decided on the host: identical on every TP rank.
    # The embedding and the LM head (vocab.py) are named by their module: embed_tokens, lm_head.
    active: frozenset[str] = field(default_factory=frozenset)
    # the segments on the host, (seg_indptr, seg_slots): an MoE layer regroups its rows by them (worker/lora/experts.py)
    host_segments: tuple[Sequence[int], Sequence[int]] = ((0,), ())
    used_slots: tuple[int, ...] = ()  # the slots of this forward's adapter rows
    # each token's request strength (lora_scale) on the host, None when every one is 1 (meta.row_scales on the device)
    host_row_scales: Sequence[float] | None = None
    # Only where the pool covers the embedding or the LM head: each token's slot (-1: base), and that of each row
    # the LM head computes (ModelRunner picks the rows: LoRAManager.select_rows).
    token_slots: torch.Tensor | None = None  # (tokens,)
    row_slots: torch.Tensor | None = None  # (rows,)
    token_scales: torch.Tensor | None = None  # (tokens,) float32, as token_slots; None: all 1
    row_scales: torch.Tensor | None = None  # (rows,)
    # Only where a slot of this forward holds a DoRA adapter: the fused linears it targets, and each token's row of
    # their DoraTable (its slot; the table's last row, all ones, for the base)
    dora_active: frozenset[str] = field(default_factory=frozenset)
    dora_rows: torch.Tensor | None = None  # (tokens,) int64

    def vocab_slots(self, module: str, buffers: VocabLoRABuffers) -> list[int]:
        """This forward's slots whose adapter targets `module` (embed_tokens or lm_head)."""
        if module not in self.active:
            return []
        return [slot for slot in self.used_slots if buffers.host_ranks[slot]]


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
        # The LoRA term goes into the base layer's output before the layer finishes it, so a row-parallel layer's one
        # all-reduce sums it too: there x holds this rank's input columns and A the matching columns, and
        # Σ_ranks (x_i·A_iᵀ)·Bᵀ = (Σ_ranks x_i·A_iᵀ)·Bᵀ with B whole on every rank. No reduction of h of its own.
        y = self.base.partial(x)  # (tokens, out_per_rank): before the row-parallel all-reduce and bias
        batch = self.batch
        if self.fused_name in batch.active:
            if x.stride(-1) != 1:
                x = x.contiguous()
            batch.backend.shrink_expand(y, x, self.buffers, batch.meta)
            if self.fused_name in batch.dora_active:  # DoRA rows: (x·Wᵀ + scale·x·Aᵀ·Bᵀ) · m / ‖W + scale·B·A‖
                self.buffers.dora.apply(y, batch.dora_rows)  # per output column, so before the all-reduce too
        return self.base.finish(y)

    def extra_repr(self) -> str:
        return f"slots={self.buffers.lora_a.shape[0]}, max_rank={self.buffers.max_rank}"
