"""LoRAPool: the device slot buffers every adapter in a batch is read from.

Per layer per fused linear that the pool targets:
  lora_a  (slots, num_slices * max_rank, in_per_rank)   slice s of slot n holds A rows s*max_rank ... s*max_rank + r
  lora_b  (slots, max_rank, out_per_rank)               rows 0 ... r, slice s's output columns
zero-padded past the adapter's rank, and zero for a slice the adapter does not target. An MoE layer's experts have
one row per (slot, expert) instead of per slot (LoRABuffers.num_experts). Shared by all layers: slot_scales (slots,)
and, per fused linear kind, slot_ranks (slots,): the adapter's r where it targets any slice of
that kind, else 0, so the kernels skip the slot there (an attention-only adapter costs nothing in the MLP).
A DoRA adapter's row scales go into each linear's DoraTable (dora.py), made at the first such adapter.
The embedding's and the LM head's slots, where the pool targets them, are vocab.py's VocabLoRABuffers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from loraplex.worker.lora.adapter import LoRAAdapter, PoolSpec
from loraplex.worker.lora.dora import DoraTable
from loraplex.worker.lora.targets import (
    EXPERT_FUSED_LINEARS,
    FUSED_LINEARS,
    KINDS_OF,
    SHARED_FUSED_LINEARS,
    FusedLinear,
)
from loraplex.worker.lora.vocab import VocabLoRABuffers
from torch import nn


@dataclass(frozen=True)
class LoRABuffers:
    """One fused linear's slots in one layer, and the metadata its kernels take."""

    fused: FusedLinear
    lora_a: torch.Tensor  # (slots, num_slices * max_rank, in_per_rank)
    lora_b: torch.Tensor  # (slots, max_rank, out_per_rank): Bᵀ, so a range of slots is one (slots * rank, out) matrix
    slice_offsets: torch.Tensor  # (num_slices + 1,) int32: each slice's columns of lora_b = columns of the output
    row_offsets: tuple[int, ...]  # the same, on the host
    slot_ranks: torch.Tensor  # (slots,) int32, shared by every layer's buffers of this kind
    slot_scales: torch.Tensor  # (slots,) float32, shared by all buffers
    host_ranks: list[int]  # slot_ranks on the host (the pool writes both), so no op reads them back
    host_scales: list[float]  # slot_scales on the host
    # Experts' linears: every tensor above has one row per (slot, expert), slot-major: the kernels see slot * experts
    # + expert as a slot of its own (worker/lora/experts.py), and ranks and scales are repeated per expert.
    num_experts: int = 1
    # DoRA's row scales per slot (worker/lora/dora.py); its tensor is made when a DoRA adapter first fills a slot
    dora: DoraTable | None = None

    @property
    def num_slices(self) -> int:
        return len(self.fused.slices)

    def rows_of(self, slot: int) -> slice:
        """The rows of the tensors above that belong to `slot`."""
        return slice(slot * self.num_experts, (slot + 1) * self.num_experts)

    @property
    def max_rank(self) -> int:
        return self.lora_b.shape[1]


class LoRAPool:
    def __init__(self, layers: Sequence[nn.Module], spec: PoolSpec, num_slots: int,
                 vocab_shapes: dict[str, tuple[int, int]]):  # fmt: skip
        """`layers`: the model's decoder layers, before any linear is wrapped; `vocab_shapes`: (in, out) of the
        embedding and the LM head (embed_tokens: (vocab, hidden), lm_head: (hidden, vocab)), of which those that
        the spec targets get buffers."""
        self.spec = spec
        self.num_slots = num_slots
        self.max_rank = spec.max_lora_rank
        # A fused linear gets buffers if any of its slices is a pool target; its other slices stay zero. Each layer
        # has those of the kinds it has (an MoE layer: the experts' in place of the dense MLP's).
        targets = set(spec.target_modules)
        candidates = [f for f in (*FUSED_LINEARS, *EXPERT_FUSED_LINEARS, *SHARED_FUSED_LINEARS)
                      if set(f.modules) & targets]  # fmt: skip
        device = spec.device
        self.buffers: dict[tuple[int, str], LoRABuffers] = {}
        self.dora_slots: set[int] = set()  # slots holding a DoRA adapter
        linears = {}
        for layer_id, layer in enumerate(layers):
            for fused in candidates:
                linear = _submodule(layer, fused.name)
                if linear is not None:
                    linears[(layer_id, fused.name)] = linear
        self.fused_linears = [f for f in candidates if any(name == f.name for _, name in linears)]
        # per-slot values; an experts' kind repeats them per expert (rows slot * experts + expert)
        self.experts_of = {name: getattr(linear, "num_experts", 1) for (_, name), linear in linears.items()}
        self.slot_scales: dict[int, torch.Tensor] = {}
        self.host_scales: dict[int, list[float]] = {}
        for num_experts in {*self.experts_of.values(), 1}:
            self.slot_scales[num_experts] = torch.zeros(num_slots * num_experts, dtype=torch.float32, device=device)
            self.host_scales[num_experts] = [0.0] * (num_slots * num_experts)
        self.slot_ranks = {f.name: torch.zeros(num_slots * self.experts_of[f.name], dtype=torch.int32, device=device)
                           for f in self.fused_linears}  # fmt: skip
        self.host_ranks = {f.name: [0] * (num_slots * self.experts_of[f.name]) for f in self.fused_linears}
        for (layer_id, name), linear in linears.items():
            fused = next(f for f in self.fused_linears if f.name == name)
            self.buffers[(layer_id, name)] = self._make_buffers(fused, linear)
        # (layer, HF module) -> the buffers and slice that hold it in that layer
        self.slice_of = {
            (layer_id, module): (buffers, slice_id)
            for (layer_id, _), buffers in self.buffers.items()
            for slice_id, module in enumerate(buffers.fused.slices)
        }
        self.vocab = {
            module: VocabLoRABuffers.empty(module, *shape, num_slots, self.max_rank, self.host_scales[1], spec.dtype,
                                           device)  # fmt: skip
            for module, shape in vocab_shapes.items()
            if module in spec.target_modules
        }

    def _make_buffers(self, fused: FusedLinear, linear: nn.Module) -> LoRABuffers:
        if linear.tp_mode != fused.tp_mode or linear.num_slices != len(fused.slices):
            raise TypeError(f"{fused.name} is a {linear.tp_mode}-parallel linear of {linear.num_slices} slices")
        num_experts = self.experts_of[fused.name]
        num_rows = self.num_slots * num_experts
        row_offsets = (*linear.output_offsets_per_rank, sum(linear.output_sizes_per_rank))
        shape_a = (num_rows, len(fused.slices) * self.max_rank, linear.input_size_per_rank)
        shape_b = (num_rows, self.max_rank, row_offsets[-1])
        device, dtype = self.spec.device, self.spec.dtype
        return LoRABuffers(
            fused=fused,
            lora_a=torch.zeros(shape_a, dtype=dtype, device=device),
            lora_b=torch.zeros(shape_b, dtype=dtype, device=device),
            slice_offsets=torch.tensor(row_offsets, dtype=torch.int32, device=device),
            row_offsets=row_offsets,
            slot_ranks=self.slot_ranks[fused.name],
            slot_scales=self.slot_scales[num_experts],
            host_ranks=self.host_ranks[fused.name],
            host_scales=self.host_scales[num_experts],
            num_experts=num_experts,
            dora=DoraTable(self.num_slots, row_offsets[-1], dtype, device),
        )

    @torch.no_grad()
    def load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Make `slot` hold exactly this adapter: zero it, then copy the adapter's weights, ranks and scale."""
        if adapter.lora_rank > self.max_rank or not set(adapter.target_modules) <= set(self.spec.target_modules):
            raise ValueError(f"adapter {adapter.lora_id} does not fit the pool")  # load_adapter checked: a bug
        self.clear_slot(slot)
        for (layer_id, module), (lora_a, lora_b) in adapter.weights.items():
            buffers, slice_id = self.slice_of[(layer_id, module)]
            r = lora_a.shape[-2]  # the module's own rank (a rank_pattern's), within the adapter's
            a_start = slice_id * self.max_rank
            b_start, b_end = buffers.row_offsets[slice_id], buffers.row_offsets[slice_id + 1]
            # (r, in_per_rank) and (r, out_of_slice); (experts, ...) each for an experts' linear
            rows = slot if buffers.num_experts == 1 else buffers.rows_of(slot)
            buffers.lora_a[rows, a_start : a_start + r].copy_(lora_a, non_blocking=True)
            buffers.lora_b[rows, :r, b_start:b_end].copy_(lora_b.mT, non_blocking=True)
        for module, (lora_a, lora_b) in adapter.vocab_weights.items():
            self.vocab[module].load(slot, lora_a, lora_b)
        if adapter.dora is not None:  # complete: the manager reduced its norms
            for key in adapter.dora.magnitudes:
                buffers, slice_id = self.slice_of[key]
                cols = slice(buffers.row_offsets[slice_id], buffers.row_offsets[slice_id + 1])
                buffers.dora.write(slot, cols, adapter.dora.row_scales(key, self.spec.dtype))
            self.dora_slots.add(slot)
        targeted = {name for module in adapter.target_modules for name in KINDS_OF.get(module, ())}
        for name, ranks in self.slot_ranks.items():
            rows = slice(slot * self.experts_of[name], (slot + 1) * self.experts_of[name])
            rank = adapter.lora_rank if name in targeted else 0
            ranks[rows] = rank
            self.host_ranks[name][rows] = [rank] * (rows.stop - rows.start)
        scale = torch.tensor(adapter.scale, dtype=torch.float32).item()  # as float32 holds it
        for num_experts, scales in self.slot_scales.items():
            rows = slice(slot * num_experts, (slot + 1) * num_experts)
            scales[rows] = adapter.scale
            self.host_scales[num_experts][rows] = [scale] * num_experts

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        for buffers in self.buffers.values():
            buffers.lora_a[buffers.rows_of(slot)].zero_()
            buffers.lora_b[buffers.rows_of(slot)].zero_()
            if slot in self.dora_slots:
                buffers.dora.clear(slot)
        for vocab_buffers in self.vocab.values():
            vocab_buffers.clear(slot)
        self.dora_slots.discard(slot)
        for name, ranks in self.slot_ranks.items():
            rows = slice(slot * self.experts_of[name], (slot + 1) * self.experts_of[name])
            ranks[rows] = 0
            self.host_ranks[name][rows] = [0] * (rows.stop - rows.start)
        for num_experts, scales in self.slot_scales.items():
            rows = slice(slot * num_experts, (slot + 1) * num_experts)
            scales[rows] = 0.0
            self.host_scales[num_experts][rows] = [0.0] * num_experts

    @property
    def num_bytes(self) -> int:
        dora = sum(b.dora.num_bytes for b in self.buffers.values() if b.dora is not None)
        linears = dora + sum(b.lora_a.nbytes + b.lora_b.nbytes for b in self.buffers.values())
        return linears + sum(b.num_bytes for b in self.vocab.values())


def _submodule(layer: nn.Module, name: str) -> nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:  # this layer has no such linear (an MoE layer has no dense MLP, and back)
        return None
