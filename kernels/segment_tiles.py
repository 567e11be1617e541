from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

# Row tiles are numbered segment after segment, skipping empty and base segments. Each program
# rebuilds that numbering from seg_indptr with one vector scan, so launches need no host sync and
# no extra torch ops to build a tile map.


def device_scope(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device and stream, not the tensor's: make the tensor's device current."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def plan_tiles(num_tokens: int, num_segments: int) -> tuple[int, int, int]:
    avg_seg_len = num_tokens / max(num_segments, 1)
    block_m = 16 if avg_seg_len <= 16 else 32 if avg_seg_len <= 32 else 64
    seg_block = max(16, triton.next_power_of_2(num_segments))
    # sum(cdiv(len, block_m)) <= cdiv(tokens, block_m) + num_segments; spare programs exit at once.
    num_tiles_bound = triton.cdiv(num_tokens, block_m) + num_segments
    return block_m, seg_block, num_tiles_bound


@triton.jit
def segment_tile(tile_id, seg_indptr_ptr, seg_slots_ptr, num_segments, BLOCK_M: tl.constexpr, SEG_BLOCK: tl.constexpr):
    seg_ids = tl.arange(0, SEG_BLOCK)
    in_range = seg_ids < num_segments
    starts = tl.load(seg_indptr_ptr + seg_ids, mask=in_range, other=0)
    ends = tl.load(seg_indptr_ptr + seg_ids + 1, mask=in_range, other=0)
    slots = tl.load(seg_slots_ptr + seg_ids, mask=in_range, other=-1)
    num_tiles = tl.where(slots >= 0, tl.cdiv(ends - starts, BLOCK_M), 0)
    tile_ends = tl.cumsum(num_tiles, 0)
    seg = tl.sum((tile_ends <= tile_id).to(tl.int32), 0)
    is_seg = seg_ids == seg  # all false for a spare tile past the last one
    first_tile = tl.sum(tl.where(is_seg, tile_ends - num_tiles, 0), 0)
    row_start = tl.sum(tl.where(is_seg, starts, 0), 0) + (tile_id - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(is_seg, ends, 0), 0)
    slot = tl.sum(tl.where(is_seg, slots + 1, 0), 0) - 1  # -1 for a spare tile
    return slot, row_start, row_end
