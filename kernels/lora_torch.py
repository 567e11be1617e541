from __future__ import annotations

import torch

from kernels.checks import check_expand_args, check_shrink_args

# The CPU serving path and the oracle for the Triton kernels. One host read of the metadata per call,
# then one matmul per active segment (per slice for expand), cut to the adapter's true rank.


def _active_segments(
    seg_indptr: torch.Tensor, seg_slots: torch.Tensor, slot_ranks: torch.Tensor
) -> list[tuple[int, int, int, int]]:
    row_bounds = seg_indptr.tolist()
    slots = seg_slots.tolist()
    ranks = slot_ranks.tolist()
    return [
        (slot, ranks[slot], row_bounds[seg], row_bounds[seg + 1])
        for seg, slot in enumerate(slots)
        if slot >= 0 and ranks[slot] > 0 and row_bounds[seg + 1] > row_bounds[seg]
    ]


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
    h = x.new_zeros(num_tokens, num_slices * max_rank)  # (tokens, slices * max_rank)
    for slot, rank, row_start, row_end in _active_segments(seg_indptr, seg_slots, slot_ranks):
        num_rows = row_end - row_start
        a = lora_a[slot].view(num_slices, max_rank, in_dim)[:, :rank]  # (slices, rank, in_dim)
        h_seg = x[row_start:row_end] @ a.reshape(num_slices * rank, in_dim).T  # (rows, slices * rank)
        h[row_start:row_end].view(num_rows, num_slices, max_rank)[:, :, :rank] = h_seg.view(num_rows, num_slices, rank)
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
    scales = slot_scales.tolist()
    for slot, rank, row_start, row_end in _active_segments(seg_indptr, seg_slots, slot_ranks):
        for slice_id, (col_start, col_end) in enumerate(zip(col_bounds[:-1], col_bounds[1:], strict=True)):
            if col_end <= col_start:
                continue
            h_slice = h[row_start:row_end, slice_id * max_rank : slice_id * max_rank + rank]  # (rows, rank)
            b = lora_b[slot, col_start:col_end, :rank]  # (slice_out, rank)
            y[row_start:row_end, col_start:col_end].addmm_(h_slice, b.T, alpha=scales[slot])
