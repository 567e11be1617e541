"""The CPU serving path and the oracle for the Triton kernels, in torch ops.

A decode batch has many short segments (one row per request, a few requests per adapter). On a CPU a matmul costs a
fixed ~40 µs before any arithmetic, so a matmul per segment, or per slot, is mostly overhead. Instead the short
segments' rows are multiplied against the A of every slot in a group at once, one (rows, slots * rank) product, and a
one-hot mask keeps each row's own slot's columns; the masked product times the group's stacked Bᵀ is then exactly
each row's own expand, again one matmul per slice. That spends slots× the arithmetic of the rows' own products, which
is small next to reading the weights as long as rows × slots stays under MAX_GROUP_PAIRS; bigger batches split into
groups of nearby slots. A group's weights are a view of the pool when its slots are (nearly) a contiguous range, as
the scheduler's sorted batches over a full pool are; scattered slots are gathered into a copy that is kept until the
pool is written or the batch's slots change. Long segments (prefill chunks) get one matmul each, cut to the adapter's
true rank. The pool is zero past each adapter's rank and in every empty slot, so the grouped path may run over the
full max rank and over slots no row uses.

With the compiled CPU kernels of cpu_ext (the `cpu` backend), the rows of every segment up to COMPILED_SEGMENT_ROWS
long go to them instead, which do exactly each row's own products in one call per linear, with no wasted arithmetic
and no matmul call overhead (prefill segments included: a segment's own bfloat16 matmuls cost ~100 µs per call, slice
by slice, where the kernels take a few µs a row). shrink_expand_compiled does shrink and expand in one such call (every
LoRA linear uses it: a row-parallel one adds its term before the layer's all-reduce, so nothing runs between them).

The worker reaches this module through its backend object (kernels/backend.py), which makes the plan once per
forward pass and passes the pool's host copies of ranks, scales and slice bounds: `*_planned`. The same computation
from tensors alone, the reference the other backends are checked against, is tests/kernel_refs.py's `lora_*_torch`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

SHORT_SEGMENT_ROWS = 16  # segments up to this long go through the grouped path; longer ones get a matmul of their own
# ... or, where the compiled kernels run, through them: in a decode step with a prefill beside it, they beat the
# segment's own matmuls at every length measured up to 1024 rows (LoRA ms per step, 8 adapters: 64 rows 16 vs 27,
# 300 rows 37 vs 46); past this many rows the matmuls' arithmetic rate wins out
COMPILED_SEGMENT_ROWS = 512
# A group's product spends (its rows) × (its slots) row-slot pairs of arithmetic where each row needs one; past this
# many pairs a CPU matmul stops hiding the extra work behind the weight read, and the group splits.
MAX_GROUP_PAIRS = 1024
# A view may span slots the group does not use: each costs a slot's weight read. So a view while the slots it spans
# are at most this many times the used ones; a gathered copy beyond.
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
class _Group:
    """Short segments of a few slots, computed against all of the group's slots at once."""

    slots: slice | tuple[int, ...]  # the pool's slots: a range (weights are a view) or scattered (a gathered copy)
    slot_index: torch.Tensor | None  # (num_slots,) int64 of scattered slots, for the gather; None for a range
    num_slots: int
    rows: torch.Tensor | None  # (rows,) int64: the batch rows of the group, None = every row of the batch in order
    own_columns: torch.Tensor  # (rows,) int64: row i's own slot's block in the flat (rows * num_slots) product
    one_hot: torch.Tensor  # (rows, num_slots) float32: 1 at each row's own slot


@dataclass(frozen=True)
class _Plan:
    groups: list[_Group]  # torch ops: one masked matmul pair each
    # compiled kernels: (tokens,) int64, each row's slot if it is in a short segment, else -1; None if none is
    row_slots: torch.Tensor | None
    separate: list[_Segment]  # one matmul each


def make_plan(row_bounds: list[int], slots: list[int], device: torch.device, compiled: bool) -> _Plan:
    """The plan of a batch's segments (host lists), made once per forward pass by the backend (kernels/backend.py)."""
    max_short_rows = COMPILED_SEGMENT_ROWS if compiled else SHORT_SEGMENT_ROWS
    separate: list[_Segment] = []
    short_rows: dict[int, list[int]] = {}  # slot -> its rows in short segments (a slot may have several segments)
    for seg, slot in enumerate(slots):
        segment = _Segment(slot, row_bounds[seg], row_bounds[seg + 1])
        if slot < 0 or segment.num_rows == 0:
            continue
        if segment.num_rows > max_short_rows:
            separate.append(segment)
        else:
            short_rows.setdefault(slot, []).extend(range(segment.row_start, segment.row_end))
    if not compiled:
        groups = [_make_group(group, short_rows, row_bounds[-1], device) for group in _split_groups(short_rows)]
        return _Plan(groups=groups, row_slots=None, separate=separate)
    row_slots = [-1] * row_bounds[-1]
    for slot, rows in short_rows.items():
        for row in rows:
            row_slots[row] = slot
    row_slots_tensor = torch.tensor(row_slots, dtype=torch.int64, device=device) if short_rows else None
    return _Plan(groups=[], row_slots=row_slots_tensor, separate=separate)


def _split_groups(short_rows: dict[int, list[int]]) -> list[list[int]]:
    """Slots in pool order, cut into runs whose rows × slots stay within MAX_GROUP_PAIRS (a slot with more rows
    than that is a group of its own)."""
    groups: list[list[int]] = []
    group: list[int] = []
    num_rows = 0
    for slot in sorted(short_rows):
        rows = len(short_rows[slot])
        if group and (num_rows + rows) * (len(group) + 1) > MAX_GROUP_PAIRS:
            groups.append(group)
            group, num_rows = [], 0
        group.append(slot)
        num_rows += rows
    if group:
        groups.append(group)
    return groups


def _make_group(
    group_slots: list[int], short_rows: dict[int, list[int]], num_tokens: int, device: torch.device
) -> _Group:
    first, last = group_slots[0], group_slots[-1]
    if last - first + 1 <= MAX_VIEW_SPAN * len(group_slots):
        slots: slice | tuple[int, ...] = slice(first, last + 1)
        place = {slot: slot - first for slot in group_slots}
        slot_index, num_slots = None, last - first + 1
    else:
        slots = tuple(group_slots)
        place = {slot: i for i, slot in enumerate(group_slots)}
        slot_index, num_slots = torch.tensor(group_slots, dtype=torch.int64, device=device), len(group_slots)
    row_slots = sorted((row, slot) for slot in group_slots for row in short_rows[slot])
    rows = [row for row, _ in row_slots]
    own = [place[slot] for _, slot in row_slots]
    one_hot = torch.zeros(len(rows), num_slots, dtype=torch.float32)
    one_hot[range(len(rows)), own] = 1.0
    return _Group(
        slots=slots,
        slot_index=slot_index,
        num_slots=num_slots,
        rows=None if rows == list(range(num_tokens)) else torch.tensor(rows, dtype=torch.int64, device=device),
        own_columns=torch.tensor([i * num_slots + p for i, p in enumerate(own)], dtype=torch.int64, device=device),
        one_hot=one_hot.to(device),
    )


# Gathered copies of scattered slots' weights, one per pool tensor: (pool, its version when gathered, slots, copy).
# The version counter moves with every write to the pool (a slot load), so a stale copy is never used; an entry
# goes when its pool does.
_gathered: dict[int, tuple[weakref.ref, int, tuple[int, ...], torch.Tensor]] = {}


def _group_weights(pool: torch.Tensor, group: _Group) -> torch.Tensor:
    """(num_slots, ...) the group's slots of a pool tensor: a view of a range, or a (kept) gathered copy."""
    if group.slot_index is None:
        return pool[group.slots]
    if pool.is_inference():  # no version counter: the copy could not tell that the pool changed
        return pool.index_select(0, group.slot_index)
    key = id(pool)
    entry = _gathered.get(key)
    if entry is not None and entry[0]() is pool and entry[1] == pool._version and entry[2] == group.slots:
        return entry[3]
    gathered = pool.index_select(0, group.slot_index)
    forget = weakref.ref(pool, lambda _, key=key: _gathered.pop(key, None))
    _gathered[key] = (forget, pool._version, group.slots, gathered)
    return gathered


def shrink_planned(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    slot_ranks: torch.Tensor,
    num_slices: int,
    plan: _Plan,
    ranks: Sequence[int] | None,
    compiled: ModuleType | None,
) -> torch.Tensor:
    """The shrink on checked arguments and a plan made once per batch; `ranks` is slot_ranks on the host (None: read
    it from the device when a long segment needs it); `compiled` the CPU kernels when the plan was made for them."""
    num_tokens, width = x.shape[0], lora_a.shape[1]
    max_rank = width // num_slices
    if plan.row_slots is not None:
        h = x.new_empty(num_tokens, width)
        compiled.shrink(x, lora_a, plan.row_slots, slot_ranks, num_slices, h)  # zero outside the short rows
    elif len(plan.groups) == 1 and plan.groups[0].rows is None:
        return _shrink_group(x, lora_a, plan.groups[0], width)  # every row, in order
    else:
        h = x.new_zeros(num_tokens, width)
        for group in plan.groups:
            h.index_copy_(0, group.rows, _shrink_group(x.index_select(0, group.rows), lora_a, group, width))
    if plan.separate and ranks is None:
        ranks = slot_ranks.tolist()
    for seg in plan.separate:
        rank, num_rows = ranks[seg.slot], seg.num_rows
        if rank == 0:
            continue
        h_seg = _shrink_segment(x, lora_a, seg, rank, num_slices)
        h[seg.row_start : seg.row_end].view(num_rows, num_slices, max_rank)[:, :, :rank] = h_seg.view(
            num_rows, num_slices, rank
        )
    return h


def _shrink_segment(x: torch.Tensor, lora_a: torch.Tensor, seg: _Segment, rank: int, num_slices: int) -> torch.Tensor:
    """(rows, slices * rank): a long segment's rows times its slot's A, cut to the adapter's rank."""
    in_dim = x.shape[1]
    a = lora_a[seg.slot].view(num_slices, -1, in_dim)[:, :rank]  # (slices, rank, in_dim)
    return x[seg.row_start : seg.row_end] @ a.reshape(num_slices * rank, in_dim).T


def _shrink_group(x: torch.Tensor, lora_a: torch.Tensor, group: _Group, width: int) -> torch.Tensor:
    """(rows, width): each row of x times its own slot's A, out of one product with every slot of the group."""
    a = _group_weights(lora_a, group).reshape(group.num_slots * width, x.shape[1])  # (slots * width, in_dim)
    h_all = x @ a.T  # (rows, slots * width)
    return h_all.view(-1, width).index_select(0, group.own_columns)


def expand_planned(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scales: torch.Tensor,
    col_bounds: Sequence[int],
    plan: _Plan,
    ranks: Sequence[int] | None,
    scales: Sequence[float] | None,
    compiled: ModuleType | None,
) -> None:
    """The expand on checked arguments and a plan made once per batch; col_bounds, ranks and scales are slice_offsets,
    slot_ranks and slot_scales on the host (ranks and scales None: read from the device when a long segment needs
    them)."""
    max_rank = lora_b.shape[1]
    slices = _slices(col_bounds)
    num_slices = len(col_bounds) - 1
    if plan.row_slots is not None:
        compiled.expand(y, h, lora_b, plan.row_slots, slot_ranks, slot_scales, col_bounds)
    for group in plan.groups:
        num_rows = h.shape[0] if group.rows is None else group.rows.shape[0]
        h_group = h if group.rows is None else h.index_select(0, group.rows)
        # Each row's h, scaled, in its own slot's block of (slots * rank) columns per slice, zero elsewhere.
        row_scales = group.one_hot * _group_scales(slot_scales, group)  # (rows, slots)
        h_masked = h.new_empty(num_rows, num_slices, group.num_slots, max_rank)
        torch.mul(
            h_group.view(num_rows, 1, num_slices, max_rank),
            row_scales.view(num_rows, group.num_slots, 1, 1),
            out=h_masked.permute(0, 2, 1, 3),
        )
        b = _group_weights(lora_b, group)  # (slots, max_rank, out_dim)
        for slice_id, start, end in slices:
            h_slice = h_masked[:, slice_id].reshape(num_rows, group.num_slots * max_rank)
            b_slice = b[:, :, start:end].reshape(group.num_slots * max_rank, end - start)  # a view for a range
            if group.rows is None:
                y[:, start:end].addmm_(h_slice, b_slice)
            else:
                y[:, start:end].index_add_(0, group.rows, h_slice @ b_slice)
    if not plan.separate:
        return
    if ranks is None or scales is None:
        ranks, scales = slot_ranks.tolist(), slot_scales.tolist()
    for seg in plan.separate:
        rank = ranks[seg.slot]
        if rank == 0:
            continue
        h_seg = h[seg.row_start : seg.row_end].view(seg.num_rows, num_slices, max_rank)[:, :, :rank]
        _expand_segment(y, h_seg, lora_b, seg, rank, scales[seg.slot], slices)


def _slices(col_bounds: Sequence[int]) -> list[tuple[int, int, int]]:
    """(slice, first column, end column) of each non-empty slice."""
    bounds = zip(col_bounds[:-1], col_bounds[1:], strict=True)
    return [(i, start, end) for i, (start, end) in enumerate(bounds) if end > start]


def _expand_segment(
    y: torch.Tensor,
    h_seg: torch.Tensor,
    lora_b: torch.Tensor,
    seg: _Segment,
    rank: int,
    scale: float,
    slices: list[tuple[int, int, int]],
) -> None:
    """y[segment rows] += scale · h_seg (rows, slices, rank) times the slot's B, one matmul per slice."""
    for slice_id, col_start, col_end in slices:
        b = lora_b[seg.slot, :rank, col_start:col_end]  # (rank, slice_out)
        y[seg.row_start : seg.row_end, col_start:col_end].addmm_(h_seg[:, slice_id], b, alpha=scale)


def _group_scales(slot_scales: torch.Tensor, group: _Group) -> torch.Tensor:
    return slot_scales[group.slots] if group.slot_index is None else slot_scales.index_select(0, group.slot_index)


def shrink_expand_compiled(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scales: torch.Tensor,
    slice_offsets: torch.Tensor,
    col_bounds: Sequence[int] | None,
    plan: _Plan,
    ranks: Sequence[int] | None,
    scales: Sequence[float] | None,
    compiled: ModuleType,
) -> None:
    """Shrink and expand in one compiled call for the short segments' rows of a plan made for the CPU kernels, and
    each long segment's own matmuls; the host values as in expand_planned (None: read from the device)."""
    if plan.row_slots is not None:
        compiled.shrink_expand(y, x, lora_a, lora_b, plan.row_slots, slot_ranks, slot_scales, slice_offsets)
    if not plan.separate:
        return
    num_slices = slice_offsets.shape[0] - 1
    slices = _slices(slice_offsets.tolist() if col_bounds is None else col_bounds)
    if ranks is None or scales is None:
        ranks, scales = slot_ranks.tolist(), slot_scales.tolist()
    for seg in plan.separate:
        rank = ranks[seg.slot]
        if rank > 0:
            h_seg = _shrink_segment(x, lora_a, seg, rank, num_slices).view(seg.num_rows, num_slices, rank)
            _expand_segment(y, h_seg, lora_b, seg, rank, scales[seg.slot], slices)
