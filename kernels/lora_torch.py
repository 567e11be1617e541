"""The CPU serving path and the oracle for the Triton kernels, in torch ops.

A decode batch has many short segments (one row per request, a few requests per adapter), and a matmul per segment
would cost more in call overhead than in arithmetic. So short segments of neighbouring slots go through one batched
matmul over a view of the pool's slot range (no copy of the weights): each slot in the range gets `pad_rows` rows of
a padded input, and a slot in the range that no segment uses just computes rows nobody reads. The scheduler
sends batches sorted by slot, so a step with 32 adapters is one range; adapters scattered over the pool make several.
Long segments (prefill chunks) get one matmul each, cut to the adapter's true rank. The pool is zero past each
adapter's rank, so the batched path may run over the full max rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.checks import check_expand_args, check_shrink_args

SHORT_SEGMENT_ROWS = 16  # segments up to this long are batched; longer ones get a matmul of their own
# A range pads every slot to its longest segment. Up to FREE_PAD_ROWS rows that costs next to nothing (the weight
# read dominates); beyond, while the padded area is more than MAX_PADDING_FACTOR times the real rows, the longest
# segment leaves for a matmul of its own (one prefill chunk among decodes would otherwise pad every slot).
FREE_PAD_ROWS = 4
MAX_PADDING_FACTOR = 2
# An unused slot inside a range costs one slot's weight read in the batched matmul (~8 µs for a rank-16 qkv on one
# core), a new range ~30-40 µs of call overhead: a range spans gaps of up to this many unused slots.
MAX_SLOT_GAP = 3


@dataclass(frozen=True)
class _Segment:
    slot: int
    row_start: int
    row_end: int


@dataclass(frozen=True)
class _SlotRange:
    """Short segments of the slots first_slot .. first_slot + num_slots - 1 (at most one segment per slot)."""

    first_slot: int
    num_slots: int  # gaps included
    pad_rows: int  # rows per slot in the padded layout
    rows: torch.Tensor  # (range rows,) int64: rows of the batch that the segments hold
    padded_rows: torch.Tensor  # (range rows,) int64: the same rows' places in the (num_slots * pad_rows) layout
    # (num_slots * pad_rows,) int64: the batch row each padded place reads; padding repeats a real row, whose
    # products land in rows nobody reads (one gather, no zero fill)
    gather_rows: torch.Tensor

    @property
    def slots(self) -> slice:
        return slice(self.first_slot, self.first_slot + self.num_slots)


@dataclass(frozen=True)
class _Plan:
    ranges: list[_SlotRange]  # one batched matmul each
    separate: list[_Segment]  # one matmul each
    # One range holds every row of the batch, in order (a decode batch sorted by slot): its outputs are the batch's.
    covers_batch: bool


# The plan depends only on the segment metadata, the same for every LoRA linear of a forward pass: keep the last
# one, keyed by the metadata's values (two short host reads per call, where building a plan costs tens of µs).
_last_plan: tuple[tuple, _Plan] | None = None


def _plan(seg_indptr: torch.Tensor, seg_slots: torch.Tensor) -> _Plan:
    global _last_plan
    row_bounds, slots = seg_indptr.tolist(), seg_slots.tolist()
    key = (tuple(row_bounds), tuple(slots), seg_indptr.device)
    if _last_plan is None or _last_plan[0] != key:
        _last_plan = (key, _make_plan(row_bounds, slots, seg_indptr.device))
    return _last_plan[1]


def _make_plan(row_bounds: list[int], slots: list[int], device: torch.device) -> _Plan:
    separate, short_by_slot = [], {}
    for seg, slot in enumerate(slots):
        segment = _Segment(slot, row_bounds[seg], row_bounds[seg + 1])
        if slot < 0 or segment.row_end == segment.row_start:
            continue
        if segment.row_end - segment.row_start > SHORT_SEGMENT_ROWS or slot in short_by_slot:
            separate.append(segment)  # long, or a second segment of a slot (a batch not sorted by slot)
        else:
            short_by_slot[slot] = segment
    groups: list[list[_Segment]] = []
    for slot in sorted(short_by_slot):
        if groups and slot - groups[-1][-1].slot <= MAX_SLOT_GAP + 1:
            groups[-1].append(short_by_slot[slot])
        else:
            groups.append([short_by_slot[slot]])
    ranges = []
    for group in groups:
        while (
            len(group) > 1
            and max(_num_rows(s) for s in group) > FREE_PAD_ROWS
            and _padded_area(group) > MAX_PADDING_FACTOR * sum(_num_rows(s) for s in group)
        ):
            longest = max(group, key=_num_rows)
            group.remove(longest)
            separate.append(longest)
        ranges.append(_slot_range(group, device))
    covers_batch = len(ranges) == 1 and not separate and ranges[0].rows.tolist() == list(range(row_bounds[-1]))
    return _Plan(ranges=ranges, separate=separate, covers_batch=covers_batch)


def _num_rows(segment: _Segment) -> int:
    return segment.row_end - segment.row_start


def _padded_area(group: list[_Segment]) -> int:
    return (group[-1].slot - group[0].slot + 1) * max(_num_rows(s) for s in group)


def _slot_range(segments: list[_Segment], device: torch.device) -> _SlotRange:
    first_slot = segments[0].slot
    pad_rows = max(s.row_end - s.row_start for s in segments)
    num_slots = segments[-1].slot - first_slot + 1
    rows, padded_rows = [], []
    gather_rows = [segments[0].row_start] * (num_slots * pad_rows)
    for s in segments:
        rows.extend(range(s.row_start, s.row_end))
        base = (s.slot - first_slot) * pad_rows
        padded_rows.extend(range(base, base + s.row_end - s.row_start))
        gather_rows[base : base + s.row_end - s.row_start] = range(s.row_start, s.row_end)
    return _SlotRange(
        first_slot=first_slot,
        num_slots=num_slots,
        pad_rows=pad_rows,
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        padded_rows=torch.tensor(padded_rows, dtype=torch.int64, device=device),
        gather_rows=torch.tensor(gather_rows, dtype=torch.int64, device=device),
    )


def _batched_matmul_t(inputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(n, rows, k) x (n, m, k) -> (n, rows, m) = inputs @ weightsᵀ per batch entry, weights a strided view of the pool.
    CPU bmm copies a transposed half-precision operand before multiplying, so for those dtypes multiply the weights
    as they lie (weights @ inputsᵀ) and transpose the small result; fp32 is fastest the direct way."""
    if inputs.dtype == torch.float32:
        return torch.bmm(inputs, weights.transpose(1, 2))
    return torch.bmm(weights, inputs.transpose(1, 2)).transpose(1, 2)


def lora_shrink_torch(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    num_slices: int,
) -> torch.Tensor:
    max_rank = check_shrink_args(x, lora_a, seg_indptr, seg_slots, slot_ranks, num_slices)
    num_tokens, in_dim = x.shape
    plan = _plan(seg_indptr, seg_slots)
    h = None if plan.covers_batch else x.new_zeros(num_tokens, num_slices * max_rank)
    for r in plan.ranges:
        x_padded = x.index_select(0, r.gather_rows)  # (range * pad_rows, in_dim)
        a = lora_a[r.slots]  # (range, slices * max_rank, in_dim), a view
        h_padded = _batched_matmul_t(x_padded.view(r.num_slots, r.pad_rows, in_dim), a)  # (range, pad_rows, S * R)
        h_rows = h_padded.reshape(r.num_slots * r.pad_rows, -1).index_select(0, r.padded_rows)
        if h is None:
            return h_rows  # (tokens, slices * max_rank): every row, in order
        h.index_copy_(0, r.rows, h_rows)
    ranks = slot_ranks.tolist() if plan.separate else []
    for seg in plan.separate:
        rank, num_rows = ranks[seg.slot], seg.row_end - seg.row_start
        if rank == 0:
            continue
        a = lora_a[seg.slot].view(num_slices, max_rank, in_dim)[:, :rank]  # (slices, rank, in_dim)
        h_seg = x[seg.row_start : seg.row_end] @ a.reshape(num_slices * rank, in_dim).T  # (rows, slices * rank)
        h[seg.row_start : seg.row_end].view(num_rows, num_slices, max_rank)[:, :, :rank] = h_seg.view(
            num_rows, num_slices, rank
        )
    return h


def lora_expand_torch(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scales: torch.Tensor,
    slice_offsets: torch.Tensor,
) -> None:
    max_rank = check_expand_args(y, h, lora_b, seg_indptr, seg_slots, slot_ranks, slot_scales, slice_offsets)
    col_bounds = slice_offsets.tolist()
    bounds = zip(col_bounds[:-1], col_bounds[1:], strict=True)
    slices = [(i, start, end) for i, (start, end) in enumerate(bounds) if end > start]
    num_slices, out_dim = len(col_bounds) - 1, y.shape[1]
    plan = _plan(seg_indptr, seg_slots)
    for r in plan.ranges:
        h_padded = h.index_select(0, r.gather_rows)  # (range * pad_rows, slices * max_rank)
        range_scales = slot_scales[r.slots].to(h.dtype).view(-1, 1, 1, 1)
        # Every slice's rows of h against all of B (as the pool lies, no copy): the extra products are cheap next to
        # reading B, which is what a decode step's expand costs. Then keep slice i's columns of h-slice i's product.
        h_t = h.new_empty(r.num_slots, max_rank, num_slices, r.pad_rows)
        h_padded = h_padded.view(r.num_slots, r.pad_rows, num_slices, max_rank)
        torch.mul(h_padded, range_scales, out=h_t.permute(0, 3, 2, 1))  # scaled, in h_t's layout
        h_t = h_t.view(r.num_slots, max_rank, num_slices * r.pad_rows)
        out = torch.bmm(lora_b[r.slots], h_t).view(r.num_slots, out_dim, num_slices, r.pad_rows)
        if num_slices == 1:
            delta = out[:, :, 0]  # (range, out_dim, pad_rows)
        else:
            delta = torch.cat([out[:, start:end, i] for i, start, end in slices], dim=1)
        delta = delta.transpose(1, 2).reshape(r.num_slots * r.pad_rows, out_dim).index_select(0, r.padded_rows)
        y.index_add_(0, r.rows, delta)
    if not plan.separate:
        return
    ranks, scales = slot_ranks.tolist(), slot_scales.tolist()
    for seg in plan.separate:
        rank = ranks[seg.slot]
        if rank == 0:
            continue
        for slice_id, col_start, col_end in slices:
            h_slice = h[seg.row_start : seg.row_end, slice_id * max_rank : slice_id * max_rank + rank]  # (rows, rank)
            b = lora_b[seg.slot, col_start:col_end, :rank]  # (slice_out, rank)
            y[seg.row_start : seg.row_end, col_start:col_end].addmm_(h_slice, b.T, alpha=scales[seg.slot])
