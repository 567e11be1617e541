"""The CPU serving path and the oracle for the Triton kernels, in torch ops.

A decode batch has many short segments (one row per request, a few requests per adapter), and a matmul per segment
would cost more in call overhead than in arithmetic. So the short segments go through one batched matmul, one batch
entry per slot, each slot's rows padded to the longest. The weights are a view of the pool when the batch's slots are
(nearly) contiguous, as the scheduler's sorted batches over a full pool are: an unused slot in between only computes
rows nobody reads. Scattered slots are gathered into a copy instead, whose cost is a second read of just their
weights. Long segments (prefill chunks) get one matmul each, cut to the adapter's true rank. The pool is zero past
each adapter's rank, so the batched path may run over the full max rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.checks import check_expand_args, check_shrink_args

SHORT_SEGMENT_ROWS = 16  # segments up to this long are batched; longer ones get a matmul of their own
# Padding every slot to the longest segment costs next to nothing up to FREE_PAD_ROWS rows (the weight read
# dominates); beyond, while the padded rows are more than MAX_PADDING_FACTOR times the real ones, the longest segment
# leaves for a matmul of its own (one prefill chunk among decodes would otherwise pad every slot).
FREE_PAD_ROWS = 4
MAX_PADDING_FACTOR = 2
# A view may span unused slots between the batch's slots: each costs a slot's weight read and its padded rows'
# products, where a gathered copy costs about two more reads of each used slot's weights. So a view while the slots
# it spans are at most this many times the used ones.
MAX_VIEW_SPAN = 2


@dataclass(frozen=True)
class _Segment:
    slot: int
    row_start: int
    row_end: int

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start


@dataclass(frozen=True)
class _ShortBatch:
    """The short segments, at most one per slot, as one batched matmul over `num_slots` batch entries."""

    slots: slice | torch.Tensor  # the pool's slots: a slice (weights are a view) or int64 indices (a gathered copy)
    num_slots: int
    pad_rows: int  # rows per slot in the padded layout
    rows: torch.Tensor  # (short rows,) int64: rows of the batch that the segments hold
    padded_rows: torch.Tensor  # (short rows,) int64: the same rows' places in the (num_slots * pad_rows) layout
    # (num_slots * pad_rows,) int64: the batch row each padded place reads; padding repeats a real row, whose
    # products land in rows nobody reads (one gather, no zero fill)
    gather_rows: torch.Tensor
    place_slot: torch.Tensor  # (short rows,) int64: padded_rows // pad_rows, the row's batch entry
    place_row: torch.Tensor  # (short rows,) int64: padded_rows % pad_rows, its row within the entry


@dataclass(frozen=True)
class _Plan:
    short: _ShortBatch | None  # one batched matmul
    separate: list[_Segment]  # one matmul each
    # The short batch holds every row of the batch, in order (a decode batch sorted by slot): its outputs are the
    # batch's, with no scatter.
    covers_batch: bool


# The plan depends only on the segment metadata, the same for every LoRA linear of a forward pass: keep the last
# one, keyed by the metadata's values (two short host reads per call, where building a plan costs tens of µs).
_last_plan: tuple[tuple, _Plan] | None = None


def _plan(seg_indptr: torch.Tensor, seg_slots: torch.Tensor) -> _Plan:
    global _last_plan
    row_bounds, slots = seg_indptr.tolist(), seg_slots.tolist()
    key = (tuple(row_bounds), tuple(slots), seg_indptr.device)
    cached = _last_plan  # one read: another thread's forward may replace it meanwhile
    if cached is None or cached[0] != key:
        cached = _last_plan = (key, _make_plan(row_bounds, slots, seg_indptr.device))
    return cached[1]


def _make_plan(row_bounds: list[int], slots: list[int], device: torch.device) -> _Plan:
    separate, short_by_slot = [], {}
    for seg, slot in enumerate(slots):
        segment = _Segment(slot, row_bounds[seg], row_bounds[seg + 1])
        if slot < 0 or segment.num_rows == 0:
            continue
        if segment.num_rows > SHORT_SEGMENT_ROWS or slot in short_by_slot:
            separate.append(segment)  # long, or a second segment of a slot (a batch not sorted by slot)
        else:
            short_by_slot[slot] = segment
    short = [short_by_slot[slot] for slot in sorted(short_by_slot)]
    while (
        len(short) > 1
        and max(s.num_rows for s in short) > FREE_PAD_ROWS
        and len(short) * max(s.num_rows for s in short) > MAX_PADDING_FACTOR * sum(s.num_rows for s in short)
    ):
        longest = max(short, key=lambda s: s.num_rows)
        short.remove(longest)
        separate.append(longest)
    if not short:
        return _Plan(short=None, separate=separate, covers_batch=False)
    batch = _short_batch(short, device)
    covers_batch = not separate and batch.rows.tolist() == list(range(row_bounds[-1]))
    return _Plan(short=batch, separate=separate, covers_batch=covers_batch)


def _short_batch(segments: list[_Segment], device: torch.device) -> _ShortBatch:
    first_slot, last_slot = segments[0].slot, segments[-1].slot
    if last_slot - first_slot + 1 <= MAX_VIEW_SPAN * len(segments):
        slots: slice | torch.Tensor = slice(first_slot, last_slot + 1)
        place = {s.slot: s.slot - first_slot for s in segments}
        num_slots = last_slot - first_slot + 1
    else:
        slots = torch.tensor([s.slot for s in segments], dtype=torch.int64, device=device)
        place = {s.slot: i for i, s in enumerate(segments)}
        num_slots = len(segments)
    pad_rows = max(s.num_rows for s in segments)
    rows, padded_rows = [], []
    gather_rows = [segments[0].row_start] * (num_slots * pad_rows)
    for s in segments:
        base = place[s.slot] * pad_rows
        rows.extend(range(s.row_start, s.row_end))
        padded_rows.extend(range(base, base + s.num_rows))
        gather_rows[base : base + s.num_rows] = range(s.row_start, s.row_end)
    return _ShortBatch(
        slots=slots,
        num_slots=num_slots,
        pad_rows=pad_rows,
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        padded_rows=torch.tensor(padded_rows, dtype=torch.int64, device=device),
        gather_rows=torch.tensor(gather_rows, dtype=torch.int64, device=device),
        place_slot=torch.tensor([p // pad_rows for p in padded_rows], dtype=torch.int64, device=device),
        place_row=torch.tensor([p % pad_rows for p in padded_rows], dtype=torch.int64, device=device),
    )


def _pool_slots(pool: torch.Tensor, slots: slice | torch.Tensor) -> torch.Tensor:
    return pool[slots] if isinstance(slots, slice) else pool.index_select(0, slots)


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
    if (sb := plan.short) is not None:
        x_padded = x.index_select(0, sb.gather_rows).view(sb.num_slots, sb.pad_rows, in_dim)
        a = _pool_slots(lora_a, sb.slots)  # (num_slots, slices * max_rank, in_dim)
        h_padded = _batched_matmul_t(x_padded, a)  # (num_slots, pad_rows, slices * max_rank)
        h_rows = h_padded.reshape(sb.num_slots * sb.pad_rows, -1).index_select(0, sb.padded_rows)
        if h is None:
            return h_rows  # (tokens, slices * max_rank): every row, in order
        h.index_copy_(0, sb.rows, h_rows)
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
    num_slices = len(col_bounds) - 1
    plan = _plan(seg_indptr, seg_slots)
    if (sb := plan.short) is not None:
        h_padded = h.index_select(0, sb.gather_rows).view(sb.num_slots, sb.pad_rows, num_slices, max_rank)
        entry_scales = slot_scales[sb.slots].to(h.dtype).view(-1, 1, 1, 1)
        h_t = h.new_empty(sb.num_slots, num_slices, max_rank, sb.pad_rows)
        torch.mul(h_padded, entry_scales, out=h_t.permute(0, 3, 1, 2))  # scaled, each slice a (rank, rows) matrix
        b = _pool_slots(lora_b, sb.slots)  # (num_slots, out_dim, max_rank)
        for slice_id, start, end in slices:
            out = torch.bmm(b[:, start:end], h_t[:, slice_id])  # (num_slots, slice_out, pad_rows)
            delta = out[sb.place_slot, :, sb.place_row]  # (short rows, slice_out)
            if plan.covers_batch:
                y[:, start:end] += delta
            else:
                y[:, start:end].index_add_(0, sb.rows, delta)
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
