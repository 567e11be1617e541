from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.checks import check_shrink_args
from loraplex.kernels.segment_tiles import device_scope, plan_tiles, segment_tile

BLOCK_K = 64
# Split-K: with few tokens the grid has only a few programs (one per row tile, slice and rank block), each streaming a
# whole (in_dim, rank) block of A, so the K loop is spread over up to MAX_SPLITS programs of at least MIN_SPLIT_LEN
# features each; their fp32 partial sums go to separate planes of the output, which the expand adds up as it loads them.
SPLIT_K_MAX_TOKENS = 64
MIN_SPLIT_LEN = 512
MAX_SPLITS = 16


def split_k(num_tokens: int, in_dim: int) -> tuple[int, int]:
    """(features per split-K program, a multiple of BLOCK_K; number of splits): one split above SPLIT_K_MAX_TOKENS."""
    splits = 1 if num_tokens > SPLIT_K_MAX_TOKENS else min(MAX_SPLITS, max(1, in_dim // MIN_SPLIT_LEN))
    split_len = max(BLOCK_K, triton.cdiv(triton.cdiv(in_dim, splits), BLOCK_K) * BLOCK_K)
    return split_len, max(1, triton.cdiv(in_dim, split_len))


# The split sizes depend on the batch's token count: not specialized, so they add no compiled variants.
@triton.jit(do_not_specialize=["split_k_len", "stride_h_split"])
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
    split_k_len,
    stride_xm,
    stride_a_slot,
    stride_h_split,
    stride_hm,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SEG_BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid: (row tile, slice, split × rank block). Writes h[split] only where the expand reads it: rows of adapter
    # segments, columns below the row's rank.
    slice_id = tl.program_id(1)
    num_r_blocks = tl.cdiv(max_rank, BLOCK_R)
    split = tl.program_id(2) // num_r_blocks
    r_start = (tl.program_id(2) % num_r_blocks) * BLOCK_R
    slot, row_start, row_end = segment_tile(
        tl.program_id(0), seg_indptr_ptr, seg_slots_ptr, num_segments, BLOCK_M, SEG_BLOCK
    )
    if slot < 0:
        return
    rank = tl.load(slot_ranks_ptr + slot)
    if r_start >= rank:
        return
    # split_k_len is a multiple of BLOCK_K: a split's blocks end on its end, and only in_dim needs a mask
    k_begin = tl.multiple_of(split * split_k_len, BLOCK_K)
    k_end = tl.minimum(k_begin + split_k_len, in_dim)
    rows = row_start + tl.arange(0, BLOCK_M)  # (BM,)
    r = r_start + tl.arange(0, BLOCK_R)  # (BR,)
    k = tl.arange(0, BLOCK_K)  # (BK,)
    row_mask = rows < row_end
    r_mask = r < rank
    a_rows = slice_id * max_rank + r  # (BR,) rows of lora_a[slot], also columns of h
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + (k_begin + k)[None, :]  # (BM, BK)
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_a_slot + a_rows[None, :] * in_dim + (k_begin + k)[:, None]  # (BK, BR)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k_start in range(k_begin, k_end, BLOCK_K):
        k_mask = k_start + k < in_dim
        x_tile = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a_tile = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(x_tile, a_tile, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    h_ptrs = h_ptr + split * stride_h_split + rows.to(tl.int64)[:, None] * stride_hm + a_rows[None, :]  # (BM, BR)
    tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), mask=row_mask[:, None] & r_mask[None, :])


def lora_shrink_triton(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    num_slices: int,
) -> torch.Tensor:
    """(tokens, num_slices * max_rank) h in x's dtype, zero on base rows and past each row's rank (the split-K planes
    summed here; the serving path, shrink_expand, leaves them to the expand)."""
    check_shrink_args(x, lora_a, seg_indptr, seg_slots, slot_ranks, num_slices)
    tiles = plan_tiles(x.shape[0], seg_slots.shape[0])
    return shrink_summed(x, lora_a, seg_indptr, seg_slots, slot_ranks, num_slices, tiles)


def shrink_summed(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    num_slices: int,
    tiles: tuple[int, int, int],
) -> torch.Tensor:
    """lora_shrink_triton on checked arguments and a row-tile plan: zeroed planes, then their sum."""
    h_splits = shrink_output(x, lora_a, zeroed=True)
    launch_shrink(x, lora_a, h_splits, seg_indptr, seg_slots, slot_ranks, num_slices, tiles)
    return h_splits.sum(0).to(x.dtype)  # (tokens, num_slices * max_rank)


def shrink_output(x: torch.Tensor, lora_a: torch.Tensor, *, zeroed: bool = False) -> torch.Tensor:
    """(splits, tokens, width) float32 planes for launch_shrink. The expand reads only what the shrink writes, so the
    serving path takes them uninitialized (no fill launch)."""
    _, num_splits = split_k(x.shape[0], x.shape[1])
    shape = (num_splits, x.shape[0], lora_a.shape[1])
    return x.new_zeros(shape, dtype=torch.float32) if zeroed else x.new_empty(shape, dtype=torch.float32)


def launch_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    h_splits: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    num_slices: int,
    tiles: tuple[int, int, int],
) -> None:
    """The launch alone, on checked arguments, planes from shrink_output and a row-tile plan (plan_tiles) made once per
    batch: h_splits[s] = the products over split s of the features."""
    num_tokens, in_dim = x.shape
    max_rank = lora_a.shape[1] // num_slices
    num_segments = seg_slots.shape[0]
    if num_tokens == 0 or num_segments == 0 or max_rank == 0:
        return
    block_m, seg_block, num_tiles_bound = tiles
    block_r = min(64, max(16, triton.next_power_of_2(max_rank)))
    split_len, num_splits = split_k(num_tokens, in_dim)  # as shrink_output made h_splits
    grid = (num_tiles_bound, num_slices, num_splits * triton.cdiv(max_rank, block_r))
    with device_scope(x):
        _shrink_kernel[grid](
            x,
            lora_a,
            h_splits,
            seg_indptr,
            seg_slots,
            slot_ranks,
            num_segments,
            in_dim,
            max_rank,
            split_len,
            x.stride(0),
            lora_a.stride(0),
            h_splits.stride(0),
            h_splits.stride(1),
            BLOCK_M=block_m,
            BLOCK_R=block_r,
            BLOCK_K=BLOCK_K,
            SEG_BLOCK=seg_block,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        )
