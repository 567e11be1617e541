from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from loraplex.kernels.checks import check_expand_args
from loraplex.kernels.segment_tiles import device_scope, plan_tiles, segment_tile

BLOCK_N = 64  # a multiple of 8: whole 16-byte vectors of 16-bit y and B where the columns start aligned


# The split count and plane stride depend on the batch's token count: not specialized, so they add no variants.
@triton.jit(do_not_specialize=["num_splits", "stride_h_split"])
def _expand_kernel(
    y_ptr,
    h_ptr,
    b_ptr,
    seg_indptr_ptr,
    seg_slots_ptr,
    slot_ranks_ptr,
    slot_scales_ptr,
    slice_offsets_ptr,
    row_scales_ptr,
    num_segments,
    max_rank,
    num_splits,
    stride_ym,
    stride_h_split,
    stride_hm,
    stride_b_slot,
    stride_b_rank,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SEG_BLOCK: tl.constexpr,
    COL_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_ROW_SCALES: tl.constexpr,
):
    # grid: (row tile, slice, out block within the slice); out blocks start at the slice start,
    # so none straddles two slices, and blocks past a narrow slice's end exit at once.
    slice_id = tl.program_id(1)
    # Every slice bound is a multiple of COL_ALIGN columns (checked on the host): with that hint the compiler can use
    # vector loads and stores along the columns, which bounds read from memory would otherwise rule out.
    col_start = tl.multiple_of(tl.load(slice_offsets_ptr + slice_id), COL_ALIGN) + tl.program_id(2) * BLOCK_N
    col_end = tl.multiple_of(tl.load(slice_offsets_ptr + slice_id + 1), COL_ALIGN)  # so is the mask, by 8 columns
    if col_start >= col_end:
        return
    slot, row_start, row_end = segment_tile(
        tl.program_id(0), seg_indptr_ptr, seg_slots_ptr, num_segments, BLOCK_M, SEG_BLOCK
    )
    if slot < 0:
        return
    rank = tl.load(slot_ranks_ptr + slot)
    if rank == 0:
        return
    scale = tl.load(slot_scales_ptr + slot)
    rows = row_start + tl.arange(0, BLOCK_M)  # (BM,)
    cols = col_start + tl.max_contiguous(tl.arange(0, BLOCK_N), BLOCK_N)  # (BN,)
    r = tl.arange(0, BLOCK_R)  # (BR,)
    row_mask = rows < row_end
    col_mask = cols < col_end
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + slice_id * max_rank + r[None, :]  # (BM, BR)
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_b_slot + r[:, None] * stride_b_rank + cols[None, :]  # (BR, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r_start in range(0, rank, BLOCK_R):  # only the adapter's true rank
        r_mask = r_start + r < rank
        h_mask = row_mask[:, None] & r_mask[None, :]
        h_tile = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for split in range(num_splits):  # the shrink's split-K planes, added up here (no pass of their own)
            h_tile += tl.load(h_ptrs + split * stride_h_split, mask=h_mask, other=0.0).to(tl.float32)
        b_tile = tl.load(b_ptrs, mask=r_mask[:, None] & col_mask[None, :], other=0.0)
        # h rounds to the weights' dtype, as a shrink that stored h in that dtype would
        acc = tl.dot(h_tile.to(b_tile.dtype), b_tile, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_R
        b_ptrs += BLOCK_R * stride_b_rank
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]  # (BM, BN)
    y_mask = row_mask[:, None] & col_mask[None, :]
    y_tile = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    if HAS_ROW_SCALES:  # each row's request strength (lora_scale)
        acc *= tl.load(row_scales_ptr + rows, mask=row_mask, other=0.0)[:, None]
    tl.store(y_ptrs, (y_tile + scale * acc).to(y_ptr.dtype.element_ty), mask=y_mask)


def lora_expand_triton(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scales: torch.Tensor,
    slice_offsets: torch.Tensor,
    row_scales: torch.Tensor | None = None,
) -> None:
    check_expand_args(y, h, lora_b, seg_indptr, seg_slots, slot_ranks, slot_scales, slice_offsets, row_scales)
    tiles = plan_tiles(y.shape[0], seg_slots.shape[0])
    col_align = column_alignment(slice_offsets.tolist())
    launch_expand(
        y, h.unsqueeze(0), lora_b, seg_indptr, seg_slots, slot_ranks, slot_scales, slice_offsets, tiles, col_align,
        row_scales,
    )  # fmt: skip


def column_alignment(col_bounds: Sequence[int]) -> int:
    """8 where every slice bound is a multiple of 8 columns (16 bytes of a 16-bit dtype), else 1 (scalar access)."""
    return 8 if all(bound % 8 == 0 for bound in col_bounds) else 1


def launch_expand(
    y: torch.Tensor,
    h_splits: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scales: torch.Tensor,
    slice_offsets: torch.Tensor,
    tiles: tuple[int, int, int],
    col_align: int,
    row_scales: torch.Tensor | None = None,
) -> None:
    """The launch alone, on checked arguments and a row-tile plan (plan_tiles) made once per batch. h_splits:
    (splits, tokens, num_slices * max_rank), summed over splits (lora_shrink.shrink_output's planes, or one h);
    col_align: column_alignment of the slice bounds; row_scales: (tokens,) float32 multiplied into each row's term
    (None: all 1)."""
    num_tokens, out_dim = y.shape
    max_rank = lora_b.shape[1]
    num_segments = seg_slots.shape[0]
    num_slices = slice_offsets.shape[0] - 1
    if num_tokens == 0 or num_segments == 0 or out_dim == 0 or max_rank == 0:
        return
    block_m, seg_block, num_tiles_bound = tiles
    block_r = min(64, max(16, triton.next_power_of_2(max_rank)))
    # Slice widths live on the device; out_dim bounds every slice without a sync.
    grid = (num_tiles_bound, num_slices, triton.cdiv(out_dim, BLOCK_N))
    with device_scope(y):
        _expand_kernel[grid](
            y,
            h_splits,
            lora_b,
            seg_indptr,
            seg_slots,
            slot_ranks,
            slot_scales,
            slice_offsets,
            slot_scales if row_scales is None else row_scales,  # not read without HAS_ROW_SCALES
            num_segments,
            max_rank,
            h_splits.shape[0],
            y.stride(0),
            h_splits.stride(0),
            h_splits.stride(1),
            lora_b.stride(0),
            lora_b.stride(1),
            BLOCK_M=block_m,
            BLOCK_N=BLOCK_N,
            BLOCK_R=block_r,
            SEG_BLOCK=seg_block,
            COL_ALIGN=col_align,
            DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
            HAS_ROW_SCALES=row_scales is not None,
        )
