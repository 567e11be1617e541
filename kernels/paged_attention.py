"""Paged attention in Triton: keys and values are read from their cache pages in place (no gather, no padding).

The cache is one layer's (slots, kv_heads, head_dim) tensor per K and V; token position p of a request lives at slot
`page_table[req, p // page_size] * page_size + p % page_size` (worker/kv_cache.py). The new tokens' K/V are already
written when these run, so a request attends to its cached prefix and its new tokens alike, through its pages.

- Decode (one new token per request): flash-decoding. Each program takes one request, one KV head and all the query
  heads that share it (GQA: every key block is loaded once for the group), over one split of the request's keys;
  with more than one split a second kernel merges the splits by their log-sum-exp. The split count is a launch
  argument, not derived from the lengths on the device, so a captured CUDA graph replays with any lengths.
- Extend (a chunk of new tokens per request, after its cached prefix): a row tile of one request's new tokens
  against its keys, causal, online softmax. The tiles are listed on the host (plan_extend_tiles).

Both write into rows of one (tokens, heads, head_dim) output, located by each request's first row in the batch's flat
token layout, so a batch of decodes and prefills needs no index_select of q or of the output.

Both take a layer's sliding window (`window` > 0: a query at position p sees the keys at (p - window, p]), chunked
local attention (`chunk` > 0: a query at position p sees the keys at [p - p % chunk, p], Llama 4) and logit soft-cap
(`logit_cap` > 0: scores -> cap * tanh(scores / cap), Gemma 2) as runtime arguments: one compiled variant serves
every layer. The key loops start at the window's or the chunk's first key, so a local layer reads only its keys.
Attention sinks (gpt-oss: a learned logit per query head that joins the softmax's denominator and attends to no
value) are a second variant (`HAS_SINKS`): the finished row's sum gains exp(sink - max); under decode splits, the
merge adds it once. An FP8 cache (worker/kv_cache.py) is a third (`KV_FP8`): its float8_e4m3fn bytes are converted
in registers and multiplied by the layer's k_scale / v_scale, read from a (2,) device tensor.
Each launcher checks its arguments and has a torch reference with the same signature (tests/kernel_refs.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.segment_tiles import device_scope

DECODE_BLOCK_N = 64  # keys per step of the decode loop
EXTEND_BLOCK_M = 64  # query rows per extend program
EXTEND_BLOCK_N = 64  # keys per step of the extend loop
MAX_SPLITS = 16  # most key splits of one decode request (the merge kernel's vector width)
SPLIT_MIN_TOKENS = 256  # a split shorter than this is not worth its partial output
SPLIT_TARGET_PROGRAMS = 256  # split until (requests x kv heads x splits) reaches about this (~2 per SM on H100/H200)


@triton.jit
def _soft_cap(s, logit_cap):
    # cap * tanh(s / cap), tanh from exp (the interpreter has no tanh): 1 - 2 / (exp(2x) + 1) saturates to +-1.
    return logit_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / logit_cap) + 1.0))


@triton.jit
def _fp8_to_f32(x):
    """float8_e4m3fn bytes (a uint8 view of the cache) -> float32, exactly: exponent and mantissa placed in a float16's
    (bias 15 against 7), times 2^8 for the bias (subnormals land on float16 subnormals)."""
    x = x.to(tl.uint16)
    bits = ((x & 0x7F) << 7) | ((x & 0x80) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _load_kv(ptrs, mask, scale, dtype: tl.constexpr, KV_FP8: tl.constexpr):
    """A block of keys or values in `dtype`: an FP8 cache's converted and multiplied by its scale."""
    if KV_FP8:  # one return: the compiler types every return of a function, constexpr branches included
        x = (_fp8_to_f32(tl.load(ptrs, mask=mask, other=0)) * scale).to(dtype)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def _add_sinks(acc, row_sum, m, sinks):
    # acc (R, BD) and row_sum (R,) relative to the running max m (R,): both rescaled to max(m, sink), and the sink's
    # exp(sink - max) joins the sum. m = -inf (no key): the sink alone, acc 0.
    sinks = sinks.to(tl.float32)
    m_final = tl.maximum(m, sinks)
    alpha = tl.exp(m - m_final)
    return acc * alpha[:, None], row_sum * alpha + tl.exp(sinks - m_final)


# The page table's row stride is its width, the batch's longest page list: not specialized on, or each width class
# (1, a multiple of 16, other) would be a variant of its own. Likewise the merge's split count, the window and the
# chunk size.
@triton.jit(do_not_specialize=["stride_page_table", "window", "chunk"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    page_table_ptr,
    kv_lens_ptr,
    q_rows_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    sinks_ptr,
    kv_scales_ptr,
    scale,
    window,
    chunk,
    logit_cap,
    stride_q_row,
    stride_q_head,
    stride_cache_slot,
    stride_cache_head,
    stride_page_table,
    stride_out_row,
    stride_out_head,
    HEADS_PER_KV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # grid: (request, kv head, split)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    kv_len = tl.load(kv_lens_ptr + req)
    row = tl.load(q_rows_ptr + req).to(tl.int64)
    first = 0
    if window > 0:
        first = tl.maximum(kv_len - window, 0)  # the window's oldest key
    if chunk > 0:
        first = tl.maximum(first, (kv_len - 1) // chunk * chunk)  # the first key of the query's chunk
    # Whole key blocks per split, so only the last block of a request is ragged.
    blocks_per_split = tl.cdiv(tl.cdiv(kv_len - first, BLOCK_N), num_splits)
    start = first + split * blocks_per_split * BLOCK_N
    end = tl.minimum(start + blocks_per_split * BLOCK_N, kv_len)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    h_mask = h < HEADS_PER_KV
    d_mask = d < HEAD_DIM
    heads = kv_head * HEADS_PER_KV + h  # (BH,) query heads of this KV head; rows past HEADS_PER_KV are padding
    q = tl.load(
        q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BH, BD)
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    page_row = page_table_ptr + req.to(tl.int64) * stride_page_table
    k_scale, v_scale = 1.0, 1.0
    if KV_FP8:  # read on the device: a captured graph sees scales set after capture
        k_scale = tl.load(kv_scales_ptr)
        v_scale = tl.load(kv_scales_ptr + 1)
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + n  # (BN,) key positions
        pos_mask = pos < end
        page = tl.load(page_row + pos // PAGE_SIZE, mask=pos_mask, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        kv_offsets = slot[:, None] * stride_cache_slot + kv_head * stride_cache_head + d[None, :]  # (BN, BD)
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k = _load_kv(k_cache_ptr + kv_offsets, kv_mask, k_scale, q.dtype, KV_FP8)  # (BN, BD)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (BH, BN)
        if logit_cap > 0:
            s = _soft_cap(s, logit_cap)
        s = tl.where(pos_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])  # (BH, BN)
        alpha = tl.exp(m - m_new)
        v = _load_kv(v_cache_ptr + kv_offsets, kv_mask, v_scale, q.dtype, KV_FP8)  # (BN, BD)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        m = m_new
    has_keys = row_sum > 0  # false for an empty split, or a request with no keys
    if HAS_SINKS and not SPLIT:  # with splits, the merge adds the sink once
        acc, row_sum = _add_sinks(acc, row_sum, m, tl.load(sinks_ptr + heads, mask=h_mask, other=0.0))
    result = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]  # (BH, BD)
    if SPLIT:
        num_heads = tl.num_programs(1) * HEADS_PER_KV
        part = (req * num_heads + heads).to(tl.int64) * num_splits + split  # (BH,) rows of (reqs, heads, splits)
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], result, mask=h_mask[:, None])
        lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, row_sum, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=h_mask)
    else:
        out_ptrs = out_ptr + row * stride_out_row + heads[:, None] * stride_out_head + d[None, :]
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    q_rows_ptr,
    out_ptr,
    sinks_ptr,
    num_splits,
    stride_out_row,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # grid: (request, query head); the splits' outputs weighted by exp(lse - max lse)
    req = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(q_rows_ptr + req).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    part = (req * tl.num_programs(1) + head).to(tl.int64) * num_splits + s  # (BS,)
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # a request with no keys at all: every weight 0, output 0
    w = tl.exp(lse - m)  # (BS,)
    parts = tl.load(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], mask=s_mask[:, None], other=0.0)
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.exp(sink - m)
    result = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)  # (BD,)
    tl.store(out_ptr + row * stride_out_row + head * stride_out_head + d, result.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)  # fmt: skip


@triton.jit(do_not_specialize=["stride_page_table", "window", "chunk"])
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    page_table_ptr,
    q_starts_ptr,
    q_lens_ptr,
    cached_lens_ptr,
    tile_reqs_ptr,
    tile_offsets_ptr,
    out_ptr,
    sinks_ptr,
    kv_scales_ptr,
    scale,
    window,
    chunk,
    logit_cap,
    stride_q_row,
    stride_q_head,
    stride_cache_slot,
    stride_cache_head,
    stride_page_table,
    stride_out_row,
    stride_out_head,
    HEADS_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # grid: (row tile, query head); a tile is BLOCK_M consecutive new tokens of one request
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // HEADS_PER_KV
    req = tl.load(tile_reqs_ptr + tile)
    offset = tl.load(tile_offsets_ptr + tile)  # first new token of the tile, counted within the request
    q_start = tl.load(q_starts_ptr + req)
    q_len = tl.load(q_lens_ptr + req)
    cached = tl.load(cached_lens_ptr + req)

    i = offset + tl.arange(0, BLOCK_M)  # (BM,) new-token index within the request
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    row_mask = i < q_len
    d_mask = d < HEAD_DIM
    rows = (q_start + i).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_q_row + head * stride_q_head + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BM, BD)
    q_pos = cached + i  # (BM,) positions; padding rows past q_len see keys as far as the tile's last position
    kv_end = cached + tl.minimum(offset + BLOCK_M, q_len)  # the tile's causal bound
    # Each row's oldest visible key, of its window and its chunk; padding rows count from the tile's last key, so
    # every row sees some key. The loop starts at the block holding the tile's first row's oldest key.
    last_pos = tl.minimum(q_pos, kv_end - 1)  # (BM,)
    oldest = tl.zeros((BLOCK_M,), dtype=tl.int32)
    lo = 0
    if window > 0:
        oldest = last_pos - window + 1
        lo = tl.maximum(cached + offset - window + 1, 0)
    if chunk > 0:
        oldest = tl.maximum(oldest, last_pos // chunk * chunk)
        lo = tl.maximum(lo, (cached + offset) // chunk * chunk)
    lo = lo // BLOCK_N * BLOCK_N
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    page_row = page_table_ptr + req.to(tl.int64) * stride_page_table
    k_scale, v_scale = 1.0, 1.0
    if KV_FP8:  # read on the device: a captured graph sees scales set after capture
        k_scale = tl.load(kv_scales_ptr)
        v_scale = tl.load(kv_scales_ptr + 1)
    for block_start in range(lo, kv_end, BLOCK_N):
        pos = block_start + n  # (BN,)
        pos_mask = pos < kv_end
        page = tl.load(page_row + pos // PAGE_SIZE, mask=pos_mask, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        kv_offsets = slot[:, None] * stride_cache_slot + kv_head * stride_cache_head + d[None, :]  # (BN, BD)
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k = _load_kv(k_cache_ptr + kv_offsets, kv_mask, k_scale, q.dtype, KV_FP8)  # (BN, BD)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (BM, BN)
        if logit_cap > 0:
            s = _soft_cap(s, logit_cap)
        visible = (pos[None, :] <= q_pos[:, None]) & pos_mask[None, :]
        if window > 0 or chunk > 0:
            visible = visible & (pos[None, :] >= oldest[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row whose window or chunk starts past this block has no key in it yet: keep its maximum finite
        # (exp(-inf) = 0).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        v = _load_kv(v_cache_ptr + kv_offsets, kv_mask, v_scale, q.dtype, KV_FP8)  # (BN, BD)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        m = m_new
    if HAS_SINKS:
        acc, row_sum = _add_sinks(acc, row_sum, m, tl.load(sinks_ptr + head + 0 * i))
    result = acc / row_sum[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_out_row + head * stride_out_head + d[None, :]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


# ---- plans (host side, once per batch) -------------------------------------------------------------------------


def decode_num_splits(num_reqs: int, num_kv_heads: int, max_kv_len: int) -> int:
    """Key splits per decode request: enough programs to fill the device when the batch is small, none shorter than
    SPLIT_MIN_TOKENS. A function of the batch's shape only, so a CUDA graph (max_kv_len = the context length) keeps
    one value for every replay."""
    by_length = max(1, max_kv_len // SPLIT_MIN_TOKENS)
    by_occupancy = max(1, SPLIT_TARGET_PROGRAMS // max(1, num_reqs * num_kv_heads))
    return min(MAX_SPLITS, by_length, by_occupancy)


def plan_extend_tiles(q_lens: list[int], block_m: int = EXTEND_BLOCK_M) -> tuple[list[int], list[int]]:
    """(tile_reqs, tile_offsets): the row tiles of an extend launch, request after request."""
    tile_reqs, tile_offsets = [], []
    for req, q_len in enumerate(q_lens):
        for offset in range(0, q_len, block_m):
            tile_reqs.append(req)
            tile_offsets.append(offset)
    return tile_reqs, tile_offsets


# ---- argument checks (shared by the Triton launchers and the torch references) -------------------------------------


def _check_common(op: str, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  page_table: torch.Tensor, page_size: int, kv_scales: torch.Tensor | None = None) -> None:  # fmt: skip
    if q.dim() != 3 or out.shape != q.shape:
        raise ValueError(f"{op}: q must be (tokens, heads, head_dim) and out the same shape, got {tuple(q.shape)} "
                         f"and {tuple(out.shape)}")  # fmt: skip
    if k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: k_cache and v_cache must both be (slots, kv_heads, head_dim), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")  # fmt: skip
    if k_cache.shape[2] != q.shape[2] or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"{op}: q heads {q.shape[1]} must be a multiple of the cache's kv heads {k_cache.shape[1]} "
                         f"with the same head_dim ({q.shape[2]} vs {k_cache.shape[2]})")  # fmt: skip
    cache_dtype = q.dtype if kv_scales is None else torch.float8_e4m3fn
    for name, t, dtype in (("out", out, q.dtype), ("k_cache", k_cache, cache_dtype), ("v_cache", v_cache, cache_dtype)):
        if t.dtype != dtype or t.device != q.device:
            raise ValueError(f"{op}: {name} must be {dtype} on {q.device}, got {t.dtype} on {t.device}")
    if kv_scales is not None and (kv_scales.shape != (2,) or kv_scales.dtype != torch.float32
                                  or kv_scales.device != q.device or kv_scales.stride(0) != 1):  # fmt: skip
        raise ValueError(f"{op}: kv_scales must be a contiguous (2,) float32 tensor on {q.device}, got "
                         f"{tuple(kv_scales.shape)} {kv_scales.dtype} on {kv_scales.device}")  # fmt: skip
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(2) != 1:
            raise ValueError(f"{op}: {name} must have unit stride in head_dim, got strides {t.stride()}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"{op}: k_cache and v_cache must have the same strides")
    if page_table.dim() != 2 or page_table.dtype != torch.int32 or page_table.device != q.device:
        raise ValueError(f"{op}: page_table must be 2-D int32 on {q.device}, got {tuple(page_table.shape)} "
                         f"{page_table.dtype} on {page_table.device}")  # fmt: skip
    if page_table.stride(1) != 1:
        raise ValueError(f"{op}: page_table must have unit stride in its last dim")
    if page_size < 1 or k_cache.shape[0] % page_size:
        raise ValueError(f"{op}: page_size {page_size} must divide the cache's {k_cache.shape[0]} slots")


def _check_vector(op: str, name: str, t: torch.Tensor, length: int, device: torch.device) -> None:
    if t.dim() != 1 or t.shape[0] != length or t.dtype != torch.int32 or t.device != device or t.stride(0) != 1:
        raise ValueError(f"{op}: {name} must be a contiguous ({length},) int32 tensor on {device}, got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")  # fmt: skip


def _check_chunk(op: str, chunk: int) -> None:
    if chunk < 0:
        raise ValueError(f"{op}: chunk must be 0 (none) or a positive chunk size, got {chunk}")


def _check_sinks(op: str, q: torch.Tensor, sinks: torch.Tensor | None) -> None:
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != q.shape[1] or sinks.device != q.device
                              or sinks.stride(0) != 1 or not sinks.is_floating_point()):  # fmt: skip
        raise ValueError(f"{op}: sinks must be a contiguous ({q.shape[1]},) float tensor on {q.device}, got "
                         f"{tuple(sinks.shape)} {sinks.dtype} on {sinks.device}")  # fmt: skip


def check_decode_args(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      page_table: torch.Tensor, kv_lens: torch.Tensor, q_rows: torch.Tensor, page_size: int,
                      num_splits: int, sinks: torch.Tensor | None = None, chunk: int = 0,
                      kv_scales: torch.Tensor | None = None) -> None:  # fmt: skip
    op = "paged_decode_attention"
    _check_common(op, out, q, k_cache, v_cache, page_table, page_size, kv_scales)
    _check_sinks(op, q, sinks)
    _check_chunk(op, chunk)
    num_reqs = page_table.shape[0]
    _check_vector(op, "kv_lens", kv_lens, num_reqs, q.device)
    _check_vector(op, "q_rows", q_rows, num_reqs, q.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"{op}: num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")


def check_extend_args(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      page_table: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                      cached_lens: torch.Tensor, tile_reqs: torch.Tensor, tile_offsets: torch.Tensor,
                      page_size: int, sinks: torch.Tensor | None = None, chunk: int = 0,
                      kv_scales: torch.Tensor | None = None) -> None:  # fmt: skip
    op = "paged_extend_attention"
    _check_common(op, out, q, k_cache, v_cache, page_table, page_size, kv_scales)
    _check_sinks(op, q, sinks)
    _check_chunk(op, chunk)
    num_reqs = page_table.shape[0]
    for name, t in (("q_starts", q_starts), ("q_lens", q_lens), ("cached_lens", cached_lens)):
        _check_vector(op, name, t, num_reqs, q.device)
    _check_vector(op, "tile_reqs", tile_reqs, tile_reqs.shape[0], q.device)
    _check_vector(op, "tile_offsets", tile_offsets, tile_reqs.shape[0], q.device)


# ---- launchers -----------------------------------------------------------------------------------------------------


def _sinks_arg(q: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    return q if sinks is None else sinks  # without sinks the kernels never read the pointer


def _scales_arg(q: torch.Tensor, kv_scales: torch.Tensor | None) -> torch.Tensor:
    return q if kv_scales is None else kv_scales  # without an FP8 cache the kernels never read the pointer


def _cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor,
                kv_scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """An FP8 cache as bytes: the kernels convert them (_fp8_to_f32), the same code under the interpreter."""
    if kv_scales is None:
        return k_cache, v_cache
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # the precision only matters for fp32 inputs


def paged_decode_attention_triton(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  page_table: torch.Tensor, kv_lens: torch.Tensor, q_rows: torch.Tensor,
                                  page_size: int, scale: float, num_splits: int, window: int = 0,
                                  logit_cap: float = 0.0, sinks: torch.Tensor | None = None,
                                  chunk: int = 0, kv_scales: torch.Tensor | None = None) -> None:  # fmt: skip
    """out[q_rows[r]] = attention of q[q_rows[r]] over request r's first kv_lens[r] keys (the last `window` of them
    when window > 0; with chunk > 0 only those of the query's chunk, from position p - p % chunk), for every request
    r of page_table (reqs, pages); scores soft-capped when logit_cap > 0; each head's sink logit (heads,) in the
    softmax's denominator when sinks is given. kv_scales (2,) float32: the caches are float8_e4m3fn holding K / k_scale
    and V / v_scale."""
    check_decode_args(out, q, k_cache, v_cache, page_table, kv_lens, q_rows, page_size, num_splits, sinks, chunk,
                      kv_scales)  # fmt: skip
    launch_decode(out, q, k_cache, v_cache, page_table, kv_lens, q_rows, page_size, scale, num_splits, window,
                  logit_cap, sinks, chunk, kv_scales)  # fmt: skip


def launch_decode(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  page_table: torch.Tensor, kv_lens: torch.Tensor, q_rows: torch.Tensor, page_size: int,
                  scale: float, num_splits: int, window: int = 0, logit_cap: float = 0.0,
                  sinks: torch.Tensor | None = None, chunk: int = 0,
                  kv_scales: torch.Tensor | None = None) -> None:  # fmt: skip
    """The launch alone, on checked arguments (the worker checks its shapes once, at start-up)."""
    num_reqs = page_table.shape[0]
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_reqs == 0:
        return
    heads_per_kv = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    split = num_splits > 1
    part_out = part_lse = out  # unused without splits
    if split:
        part_out = q.new_empty(num_reqs, num_heads, num_splits, block_d, dtype=torch.float32)
        part_lse = q.new_empty(num_reqs, num_heads, num_splits, dtype=torch.float32)
    with device_scope(q):
        _decode_kernel[(num_reqs, num_kv_heads, num_splits)](
            q, *_cache_args(k_cache, v_cache, kv_scales), page_table, kv_lens, q_rows, out, part_out, part_lse,
            _sinks_arg(q, sinks), _scales_arg(q, kv_scales), scale, window, chunk, float(logit_cap),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0),
            out.stride(0), out.stride(1),
            HEADS_PER_KV=heads_per_kv, BLOCK_H=max(16, triton.next_power_of_2(heads_per_kv)), HEAD_DIM=head_dim,
            BLOCK_D=block_d, PAGE_SIZE=page_size, BLOCK_N=DECODE_BLOCK_N, SPLIT=split, HAS_SINKS=sinks is not None,
            DOT_PRECISION=_dot_precision(q.dtype), KV_FP8=kv_scales is not None,
        )  # fmt: skip
        if split:
            _merge_splits_kernel[(num_reqs, num_heads)](
                part_out, part_lse, q_rows, out, _sinks_arg(q, sinks), num_splits, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=MAX_SPLITS, HAS_SINKS=sinks is not None,
            )  # fmt: skip


def paged_extend_attention_triton(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  page_table: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                                  cached_lens: torch.Tensor, tile_reqs: torch.Tensor, tile_offsets: torch.Tensor,
                                  page_size: int, scale: float, window: int = 0,
                                  logit_cap: float = 0.0, sinks: torch.Tensor | None = None,
                                  chunk: int = 0, kv_scales: torch.Tensor | None = None) -> None:  # fmt: skip
    """For every request r of page_table: out rows q_starts[r] .. + q_lens[r] = causal attention of those q rows
    (positions p = cached_lens[r] + i) over the request's keys 0..p (those past p - window when window > 0, those
    from p - p % chunk when chunk > 0), scores soft-capped when logit_cap > 0, each head's sink logit in the
    denominator when sinks is given, an FP8 cache's kv_scales as in decode. Tiles from plan_extend_tiles."""
    check_extend_args(out, q, k_cache, v_cache, page_table, q_starts, q_lens, cached_lens, tile_reqs, tile_offsets,
                      page_size, sinks, chunk, kv_scales)  # fmt: skip
    launch_extend(out, q, k_cache, v_cache, page_table, q_starts, q_lens, cached_lens, tile_reqs, tile_offsets,
                  page_size, scale, window, logit_cap, sinks, chunk, kv_scales)  # fmt: skip


def launch_extend(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  page_table: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor, cached_lens: torch.Tensor,
                  tile_reqs: torch.Tensor, tile_offsets: torch.Tensor, page_size: int,
                  scale: float, window: int = 0, logit_cap: float = 0.0,
                  sinks: torch.Tensor | None = None, chunk: int = 0,
                  kv_scales: torch.Tensor | None = None) -> None:  # fmt: skip
    num_tiles = tile_reqs.shape[0]
    _, num_heads, head_dim = q.shape
    if num_tiles == 0:
        return
    with device_scope(q):
        _extend_kernel[(num_tiles, num_heads)](
            q, *_cache_args(k_cache, v_cache, kv_scales), page_table, q_starts, q_lens, cached_lens, tile_reqs,
            tile_offsets, out, _sinks_arg(q, sinks), _scales_arg(q, kv_scales), scale, window, chunk, float(logit_cap),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0),
            out.stride(0), out.stride(1),
            HEADS_PER_KV=num_heads // k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            PAGE_SIZE=page_size, BLOCK_M=EXTEND_BLOCK_M, BLOCK_N=EXTEND_BLOCK_N, HAS_SINKS=sinks is not None,
            DOT_PRECISION=_dot_precision(q.dtype), KV_FP8=kv_scales is not None,
        )  # fmt: skip
