"""Paged latent attention (DeepSeek-V3's multi-head latent attention, absorbed form) in Triton.

The cache holds one row per token, [c | k_pe]: the latent (latent_dim, kv_lora_rank) and the rope key (rope_dim),
one KV head for every query head. The query per head is [W_ukᵀ q_nope | q_pe], laid out the same way, and the values
are the keys' leading latent_dim dims, so per query head and key j
    score_j = (q_c · c_j + q_pe · k_pe_j) * scale,      out = Σ_j softmax(score)_j c_j   (latent_dim dims)
Each step loads a block of cache rows once and uses its latent twice, for the scores and for the values, and splits
the dims as the cache does (latent_dim, rope_dim: 512 + 64 for the real model, each padded to a power of two on its
own, where 576 as one would pad to 1024).

- Decode (one new token per request): multi-query flash-decoding. A program takes one request, a block of BLOCK_H
  query heads (each key block loaded once for all of them) and one split of the request's keys; with more than one
  split the splits are merged by their log-sum-exp (kernels/paged_attention.py's merge kernel).
- Extend (a chunk of new tokens after a cached prefix): a tile of one request's new tokens and one head against its
  keys, causal, online softmax; tiles from paged_attention.plan_extend_tiles with LATENT_EXTEND_BLOCK_M rows.

Both write the (tokens, heads, latent_dim) output at each request's rows of the batch's flat token layout. The worker
runs the decode kernel (worker/layers/attention.py: LatentTritonAttention); the model runs its prefills in the
expanded form in torch, so the extend kernel is checked (tests) but not launched by the worker. Latent
attention has no sliding window or logit cap. Each launcher checks its arguments and has a torch reference with the
same signature (tests/kernel_refs.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.paged_attention import MAX_SPLITS, _check_vector, _dot_precision, _merge_splits_kernel
from loraplex.kernels.segment_tiles import device_scope

LATENT_BLOCK_H = 16  # query heads per decode program (tl.dot's smallest M); fewer heads are padded to it
LATENT_DECODE_BLOCK_N = 32  # keys per decode step: a 32 x 512 latent block, with the 16 x 512 accumulator
LATENT_EXTEND_BLOCK_M = 32  # new tokens per extend program: a 32 x 512 float32 accumulator over 8 warps
LATENT_EXTEND_BLOCK_N = 32
LATENT_STAGES = 2  # software pipelining depth: each stage holds a latent block in shared memory


def latent_head_blocks(num_heads: int) -> int:
    """Decode programs per request and split: the query heads in blocks of LATENT_BLOCK_H."""
    return triton.cdiv(num_heads, LATENT_BLOCK_H)


@triton.jit
def _latent_block(q_c, q_pe, cache_ptr, page_row, pos, pos_mask, visible, m, row_sum, acc, scale, stride_cache_slot,
                  LATENT_DIM: tl.constexpr, BLOCK_C: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    # One key block of the online softmax: q_c (M, BC), q_pe (M, BR) against the cache rows at positions pos (BN,);
    # `visible` (M, BN) the keys each row may see. -> the updated (m, row_sum, acc (M, BC)).
    page = tl.load(page_row + pos // PAGE_SIZE, mask=pos_mask, other=0)
    rows = cache_ptr + (page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE)[:, None] * stride_cache_slot  # (BN, 1)
    dc = tl.arange(0, BLOCK_C)
    dr = tl.arange(0, BLOCK_R)
    c = tl.load(rows + dc[None, :], mask=pos_mask[:, None] & (dc < LATENT_DIM)[None, :], other=0.0)  # (BN, BC)
    k_pe = tl.load(rows + LATENT_DIM + dr[None, :], mask=pos_mask[:, None] & (dr < ROPE_DIM)[None, :],
                   other=0.0)  # (BN, BR)  # fmt: skip
    s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
    s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION) * scale  # (M, BN)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet: exp(-inf) = 0
    p = tl.exp(s - m_safe[:, None])  # (M, BN)
    alpha = tl.exp(m - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)  # the latent as values
    return m_new, row_sum * alpha + tl.sum(p, 1), acc


# The page table's row stride is its width, the batch's longest page list: not specialized on (as paged_attention's).
@triton.jit(do_not_specialize=["stride_page_table"])
def _latent_decode_kernel(
    q_ptr,
    cache_ptr,
    page_table_ptr,
    kv_lens_ptr,
    q_rows_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    stride_q_row,
    stride_q_head,
    stride_cache_slot,
    stride_page_table,
    stride_out_row,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LATENT_DIM: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid: (request, head block, split)
    req = tl.program_id(0)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    kv_len = tl.load(kv_lens_ptr + req)
    row = tl.load(q_rows_ptr + req).to(tl.int64)
    # Whole key blocks per split, so only the last block of a request is ragged.
    blocks_per_split = tl.cdiv(tl.cdiv(kv_len, BLOCK_N), num_splits)
    start = split * blocks_per_split * BLOCK_N
    end = tl.minimum(start + blocks_per_split * BLOCK_N, kv_len)

    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BH,) rows past NUM_HEADS are padding
    h_mask = heads < NUM_HEADS
    dc = tl.arange(0, BLOCK_C)
    dr = tl.arange(0, BLOCK_R)
    q_row = q_ptr + row * stride_q_row + heads[:, None] * stride_q_head  # (BH, 1)
    q_c = tl.load(q_row + dc[None, :], mask=h_mask[:, None] & (dc < LATENT_DIM)[None, :], other=0.0)  # (BH, BC)
    q_pe = tl.load(q_row + LATENT_DIM + dr[None, :], mask=h_mask[:, None] & (dr < ROPE_DIM)[None, :], other=0.0)
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_C), dtype=tl.float32)
    page_row = page_table_ptr + req.to(tl.int64) * stride_page_table
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)  # (BN,) key positions
        pos_mask = pos < end
        visible = pos_mask[None, :]  # (1, BN): every head sees every key of its split
        m, row_sum, acc = _latent_block(q_c, q_pe, cache_ptr, page_row, pos, pos_mask, visible, m, row_sum, acc,
                                        scale, stride_cache_slot, LATENT_DIM, BLOCK_C, ROPE_DIM, BLOCK_R, PAGE_SIZE,
                                        DOT_PRECISION)  # fmt: skip
    has_keys = row_sum > 0  # false for an empty split, or a request with no keys
    result = acc / tl.where(has_keys, row_sum, 1.0)[:, None]  # (BH, BC)
    if SPLIT:
        part = (req * NUM_HEADS + heads).to(tl.int64) * num_splits + split  # (BH,) rows of (reqs, heads, splits)
        tl.store(part_out_ptr + part[:, None] * BLOCK_C + dc[None, :], result, mask=h_mask[:, None])
        lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, row_sum, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=h_mask)
    else:
        out_ptrs = out_ptr + row * stride_out_row + heads[:, None] * stride_out_head + dc[None, :]
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & (dc < LATENT_DIM)[None, :])


@triton.jit(do_not_specialize=["stride_page_table"])
def _latent_extend_kernel(
    q_ptr,
    cache_ptr,
    page_table_ptr,
    q_starts_ptr,
    q_lens_ptr,
    cached_lens_ptr,
    tile_reqs_ptr,
    tile_offsets_ptr,
    out_ptr,
    scale,
    stride_q_row,
    stride_q_head,
    stride_cache_slot,
    stride_page_table,
    stride_out_row,
    stride_out_head,
    LATENT_DIM: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid: (row tile, query head); a tile is BLOCK_M consecutive new tokens of one request
    tile = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(tile_reqs_ptr + tile)
    offset = tl.load(tile_offsets_ptr + tile)  # first new token of the tile, counted within the request
    q_start = tl.load(q_starts_ptr + req)
    q_len = tl.load(q_lens_ptr + req)
    cached = tl.load(cached_lens_ptr + req)

    i = offset + tl.arange(0, BLOCK_M)  # (BM,) new-token index within the request
    row_mask = i < q_len
    rows = (q_start + i).to(tl.int64)
    dc = tl.arange(0, BLOCK_C)
    dr = tl.arange(0, BLOCK_R)
    q_row = q_ptr + rows[:, None] * stride_q_row + head * stride_q_head  # (BM, 1)
    q_c = tl.load(q_row + dc[None, :], mask=row_mask[:, None] & (dc < LATENT_DIM)[None, :], other=0.0)  # (BM, BC)
    q_pe = tl.load(q_row + LATENT_DIM + dr[None, :], mask=row_mask[:, None] & (dr < ROPE_DIM)[None, :], other=0.0)
    q_pos = cached + i  # (BM,) positions; padding rows past q_len see keys as far as the tile's last position
    kv_end = cached + tl.minimum(offset + BLOCK_M, q_len)  # the tile's causal bound
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    page_row = page_table_ptr + req.to(tl.int64) * stride_page_table
    for block_start in range(0, kv_end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)  # (BN,)
        pos_mask = pos < kv_end
        visible = (pos[None, :] <= q_pos[:, None]) & pos_mask[None, :]  # (BM, BN) causal
        m, row_sum, acc = _latent_block(q_c, q_pe, cache_ptr, page_row, pos, pos_mask, visible, m, row_sum, acc,
                                        scale, stride_cache_slot, LATENT_DIM, BLOCK_C, ROPE_DIM, BLOCK_R, PAGE_SIZE,
                                        DOT_PRECISION)  # fmt: skip
    result = acc / row_sum[:, None]  # every row sees key 0 at least
    out_ptrs = out_ptr + rows[:, None] * stride_out_row + head * stride_out_head + dc[None, :]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (dc < LATENT_DIM)[None, :])


# ---- argument checks (shared by the Triton launchers and the torch references) -------------------------------------


def _check_latent_common(op: str, out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
                         page_size: int, latent_dim: int) -> None:  # fmt: skip
    if q.dim() != 3 or cache.dim() != 3 or cache.shape[1] != 1 or cache.shape[2] != q.shape[2]:
        raise ValueError(f"{op}: q must be (tokens, heads, head_dim) and cache (slots, 1, head_dim), got "
                         f"{tuple(q.shape)} and {tuple(cache.shape)}")  # fmt: skip
    if not 0 < latent_dim < q.shape[2]:
        raise ValueError(f"{op}: latent_dim {latent_dim} must leave some rope dims of head_dim {q.shape[2]}")
    if out.shape != (*q.shape[:2], latent_dim):
        raise ValueError(f"{op}: out must be (tokens, heads, latent_dim) = {(*q.shape[:2], latent_dim)}, got "
                         f"{tuple(out.shape)}")  # fmt: skip
    for name, t in (("out", out), ("cache", cache)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{op}: {name} must be {q.dtype} on {q.device}, got {t.dtype} on {t.device}")
    for name, t in (("q", q), ("out", out), ("cache", cache)):
        if t.stride(2) != 1:
            raise ValueError(f"{op}: {name} must have unit stride in its last dim, got strides {t.stride()}")
    if page_table.dim() != 2 or page_table.dtype != torch.int32 or page_table.device != q.device:
        raise ValueError(f"{op}: page_table must be 2-D int32 on {q.device}, got {tuple(page_table.shape)} "
                         f"{page_table.dtype} on {page_table.device}")  # fmt: skip
    if page_table.stride(1) != 1:
        raise ValueError(f"{op}: page_table must have unit stride in its last dim")
    if page_size < 1 or cache.shape[0] % page_size:
        raise ValueError(f"{op}: page_size {page_size} must divide the cache's {cache.shape[0]} slots")


def check_latent_decode_args(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
                             kv_lens: torch.Tensor, q_rows: torch.Tensor, page_size: int, latent_dim: int,
                             num_splits: int) -> None:  # fmt: skip
    op = "paged_latent_decode_attention"
    _check_latent_common(op, out, q, cache, page_table, page_size, latent_dim)
    num_reqs = page_table.shape[0]
    _check_vector(op, "kv_lens", kv_lens, num_reqs, q.device)
    _check_vector(op, "q_rows", q_rows, num_reqs, q.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"{op}: num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")


def check_latent_extend_args(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
                             q_starts: torch.Tensor, q_lens: torch.Tensor, cached_lens: torch.Tensor,
                             tile_reqs: torch.Tensor, tile_offsets: torch.Tensor, page_size: int,
                             latent_dim: int) -> None:  # fmt: skip
    op = "paged_latent_extend_attention"
    _check_latent_common(op, out, q, cache, page_table, page_size, latent_dim)
    num_reqs = page_table.shape[0]
    for name, t in (("q_starts", q_starts), ("q_lens", q_lens), ("cached_lens", cached_lens)):
        _check_vector(op, name, t, num_reqs, q.device)
    _check_vector(op, "tile_reqs", tile_reqs, tile_reqs.shape[0], q.device)
    _check_vector(op, "tile_offsets", tile_offsets, tile_reqs.shape[0], q.device)


# ---- launchers -----------------------------------------------------------------------------------------------------


def _dim_blocks(q: torch.Tensor, latent_dim: int) -> dict:
    rope_dim = q.shape[2] - latent_dim
    return dict(LATENT_DIM=latent_dim, BLOCK_C=max(16, triton.next_power_of_2(latent_dim)), ROPE_DIM=rope_dim,
                BLOCK_R=max(16, triton.next_power_of_2(rope_dim)))  # fmt: skip


def paged_latent_decode_attention_triton(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor,
                                         page_table: torch.Tensor, kv_lens: torch.Tensor, q_rows: torch.Tensor,
                                         page_size: int, latent_dim: int, scale: float,
                                         num_splits: int) -> None:  # fmt: skip
    """out[q_rows[r]] (heads, latent_dim) = latent attention of q[q_rows[r]] (heads, latent_dim + rope) over
    request r's first kv_lens[r] cache rows, for every request r of page_table (reqs, pages)."""
    check_latent_decode_args(out, q, cache, page_table, kv_lens, q_rows, page_size, latent_dim, num_splits)
    launch_latent_decode(out, q, cache, page_table, kv_lens, q_rows, page_size, latent_dim, scale, num_splits)


def launch_latent_decode(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
                         kv_lens: torch.Tensor, q_rows: torch.Tensor, page_size: int, latent_dim: int, scale: float,
                         num_splits: int) -> None:  # fmt: skip
    """The launch alone, on checked arguments (the worker checks its shapes once, at start-up)."""
    num_reqs = page_table.shape[0]
    num_heads = q.shape[1]
    if num_reqs == 0:
        return
    dims = _dim_blocks(q, latent_dim)
    split = num_splits > 1
    part_out = part_lse = out  # unused without splits
    if split:
        part_out = q.new_empty(num_reqs, num_heads, num_splits, dims["BLOCK_C"], dtype=torch.float32)
        part_lse = q.new_empty(num_reqs, num_heads, num_splits, dtype=torch.float32)
    with device_scope(q):
        _latent_decode_kernel[(num_reqs, latent_head_blocks(num_heads), num_splits)](
            q, cache, page_table, kv_lens, q_rows, out, part_out, part_lse, scale,
            q.stride(0), q.stride(1), cache.stride(0), page_table.stride(0), out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, BLOCK_H=LATENT_BLOCK_H, PAGE_SIZE=page_size, BLOCK_N=LATENT_DECODE_BLOCK_N,
            SPLIT=split, DOT_PRECISION=_dot_precision(q.dtype), num_warps=4, num_stages=LATENT_STAGES, **dims,
        )  # fmt: skip
        if split:
            _merge_splits_kernel[(num_reqs, num_heads)](
                part_out, part_lse, q_rows, out, num_splits, out.stride(0), out.stride(1),
                HEAD_DIM=latent_dim, BLOCK_D=dims["BLOCK_C"], BLOCK_S=MAX_SPLITS,
            )  # fmt: skip


def paged_latent_extend_attention_triton(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor,
                                         page_table: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                                         cached_lens: torch.Tensor, tile_reqs: torch.Tensor,
                                         tile_offsets: torch.Tensor, page_size: int, latent_dim: int,
                                         scale: float) -> None:  # fmt: skip
    """For every request r of page_table: out rows q_starts[r] .. + q_lens[r] = causal latent attention of those q
    rows (positions p = cached_lens[r] + i) over the request's cache rows 0..p. Tiles from
    plan_extend_tiles(q_lens, LATENT_EXTEND_BLOCK_M)."""
    check_latent_extend_args(out, q, cache, page_table, q_starts, q_lens, cached_lens, tile_reqs, tile_offsets,
                             page_size, latent_dim)  # fmt: skip
    launch_latent_extend(out, q, cache, page_table, q_starts, q_lens, cached_lens, tile_reqs, tile_offsets, page_size,
                         latent_dim, scale)  # fmt: skip


def launch_latent_extend(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
                         q_starts: torch.Tensor, q_lens: torch.Tensor, cached_lens: torch.Tensor,
                         tile_reqs: torch.Tensor, tile_offsets: torch.Tensor, page_size: int, latent_dim: int,
                         scale: float) -> None:  # fmt: skip
    num_tiles = tile_reqs.shape[0]
    if num_tiles == 0:
        return
    with device_scope(q):
        _latent_extend_kernel[(num_tiles, q.shape[1])](
            q, cache, page_table, q_starts, q_lens, cached_lens, tile_reqs, tile_offsets, out, scale,
            q.stride(0), q.stride(1), cache.stride(0), page_table.stride(0), out.stride(0), out.stride(1),
            PAGE_SIZE=page_size, BLOCK_M=LATENT_EXTEND_BLOCK_M, BLOCK_N=LATENT_EXTEND_BLOCK_N,
            DOT_PRECISION=_dot_precision(q.dtype), num_warps=8, num_stages=LATENT_STAGES, **_dim_blocks(q, latent_dim),
        )  # fmt: skip
