from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_shrink_args
from kernels.segment_tiles import device_scope, plan_tiles, segment_tile

BLOCK_K = 64


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    h_ptr,
    seg_indptr_ptr,
    seg_slots_ptr,
    slot_ranks_ptr,
    num_segments,
    in_dim,
    max_rank,
    stride_xm,
    stride_a_slot,
    stride_hm,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SEG_BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid: (row tile, slice, rank block)
    slice_id = tl.program_id(1)
    r_start = tl.program_id(2) * BLOCK_R
    slot, row_start, row_end = segment_tile(
        tl.program_id(0), seg_indptr_ptr, seg_slots_ptr, num_segments, BLOCK_M, SEG_BLOCK
    )
    if slot < 0:
        return
    rank = tl.load(slot_ranks_ptr + slot)
    if r_start >= rank:  # pool rows past the rank are zero, and h starts zeroed
        return
    rows = row_start + tl.arange(0, BLOCK_M)  # (BM,)
    r = r_start + tl.arange(0, BLOCK_R)  # (BR,)
    k = tl.arange(0, BLOCK_K)  # (BK,)
    row_mask = rows < row_end
    r_mask = r < rank
    a_rows = slice_id * max_rank + r  # (BR,) rows of lora_a[slot], also columns of h
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + k[None, :]  # (BM, BK)
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_a_slot + a_rows[None, :] * in_dim + k[:, None]  # (BK, BR)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k_start in range(0, in_dim, BLOCK_K):
        k_mask = k_start + k < in_dim
        x_tile = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a_tile = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(x_tile, a_tile, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + a_rows[None, :]  # (BM, BR)
    tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), mask=row_mask[:, None] & r_mask[None, :])


def lora_shrink_triton(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    num_slices: int,
) -> torch.Tensor:
    check_shrink_args(x, lora_a, seg_indptr, seg_slots, slot_ranks, num_slices)
    tiles = plan_tiles(x.shape[0], seg_slots.shape[0])
    return launch_shrink(x, lora_a, seg_indptr, seg_slots, slot_ranks, num_slices, tiles)


def launch_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    num_slices: int,
    tiles: tuple[int, int, int],
) -> torch.Tensor:
    """The launch alone, on checked arguments and a row-tile plan (plan_tiles) made once per batch."""
    num_tokens, in_dim = x.shape
    max_rank = lora_a.shape[1] // num_slices
    num_segments = seg_slots.shape[0]
    h = x.new_zeros(num_tokens, num_slices * max_rank)  # (tokens, slices * max_rank)
    if num_tokens == 0 or num_segments == 0 or max_rank == 0:
        return h
    block_m, seg_block, num_tiles_bound = tiles
    block_r = min(64, max(16, triton.next_power_of_2(max_rank)))
    grid = (num_tiles_bound, num_slices, triton.cdiv(max_rank, block_r))
    with device_scope(x):
        _shrink_kernel[grid](
            x,
            lora_a,
            h,
            seg_indptr,
            seg_slots,
            slot_ranks,
            num_segments,
            in_dim,
            max_rank,
            x.stride(0),
            lora_a.stride(0),
            h.stride(0),
            BLOCK_M=block_m,
            BLOCK_R=block_r,
            BLOCK_K=BLOCK_K,
            SEG_BLOCK=seg_block,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        )
    return h
