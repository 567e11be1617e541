"""Weight-only quantized matmul in Triton: y = x · Wᵀ with W dequantized tile by tile inside the kernel, so the
weight is read from memory in its stored form (INT4: two per byte, INT8: one; FP8: one byte with a scale per block).

    INT:  w[n, k] = (u[n, k] - zeros[n, k // group_size]) · scales[n, k // group_size],  u unsigned
    FP8:  w[n, k] = q[n, k] · scales[row_ids[n], col_ids[k]]

INT4 packs columns 2j and 2j+1 of a row into byte j (low nibble first). FP8 (e4m3fn) is read as its bytes and decoded
with integer ops, not Triton's float8 type, which sm_80 lacks: the same kernel compiles for sm_80 and sm_90. Products
accumulate in float32; the weight tile is cast to the activation dtype before the dot (float32: IEEE products).
Grid: (token blocks, row blocks)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.segment_tiles import device_scope

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def _dot(x, w, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(x, w, input_precision="ieee")
    return tl.dot(x, w)


@triton.jit
def _e4m3_over_256(bits):
    """float8_e4m3fn bytes (as int32) to their float32 values divided by 2^8, exactly: the sign, exponent and mantissa
    bits moved into float16's places read as a float16, whose exponent bias is 15 where e4m3's is 7 (e4m3 subnormals
    become float16 subnormals). The NaN bytes read as 480 / 2^8."""
    half_bits = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
    return half_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _int_matmul_kernel(x_ptr, q_ptr, scales_ptr, zeros_ptr, out_ptr, M, N, K, group_size, stride_xm, stride_qn,
                       stride_sn, stride_om, BITS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x_mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=x_mask, other=0.0)
        w_mask = (rk[:, None] < K) & (rn[None, :] < N)
        row_offsets = rn[None, :].to(tl.int64) * stride_qn
        if BITS == 4:
            byte = tl.load(q_ptr + row_offsets + rk[:, None] // 2, mask=w_mask, other=0).to(tl.int32)
            u = (byte >> ((rk[:, None] % 2) * 4)) & 0xF  # (BLOCK_K, BLOCK_N)
        else:
            u = tl.load(q_ptr + row_offsets + rk[:, None], mask=w_mask, other=0).to(tl.int32)
        group_offsets = rn[None, :].to(tl.int64) * stride_sn + rk[:, None] // group_size
        scale = tl.load(scales_ptr + group_offsets, mask=w_mask, other=0.0)
        zero = tl.load(zeros_ptr + group_offsets, mask=w_mask, other=0.0)
        w = (u.to(tl.float32) - zero) * scale  # (BLOCK_K, BLOCK_N)
        acc += _dot(x.to(dtype), w.to(dtype), IEEE)
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(dtype), mask=out_mask)


@triton.jit
def _fp8_matmul_kernel(x_ptr, q_ptr, scales_ptr, row_ids_ptr, col_ids_ptr, out_ptr, M, N, K, stride_xm, stride_qn,
                       stride_sr, stride_om, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = out_ptr.dtype.element_ty
    row_ids = tl.load(row_ids_ptr + rn, mask=rn < N, other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x_mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=x_mask, other=0.0)
        w_mask = (rk[:, None] < K) & (rn[None, :] < N)
        bits = tl.load(q_ptr + rn[None, :].to(tl.int64) * stride_qn + rk[:, None], mask=w_mask, other=0).to(tl.int32)
        col_ids = tl.load(col_ids_ptr + rk, mask=rk < K, other=0)
        scale = tl.load(scales_ptr + row_ids[None, :].to(tl.int64) * stride_sr + col_ids[:, None], mask=w_mask,
                        other=0.0)
        w = _e4m3_over_256(bits) * (scale * 256.0)  # (BLOCK_K, BLOCK_N); scale · 2^8 is exact
        acc += _dot(x.to(dtype), w.to(dtype), IEEE)
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(dtype), mask=out_mask)


def _check_x(op: str, x: torch.Tensor, num_cols: int) -> None:
    if x.dim() != 2 or x.shape[1] != num_cols or x.stride(1) != 1:
        raise ValueError(f"{op}: x must be (tokens, {num_cols}) with unit stride in its last dim, got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{op}: x must be float16, bfloat16 or float32, got {x.dtype}")


def check_int_matmul_args(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          group_size: int, bits: int) -> None:
    op = "int_weight_matmul"
    if bits not in (4, 8) or q.dtype != torch.uint8 or q.dim() != 2:
        raise ValueError(f"{op}: q must be a 2-D uint8 tensor of {bits}-bit values (4 or 8)")
    num_cols = q.shape[1] * (8 // bits)
    _check_x(op, x, num_cols)
    num_groups = -(-num_cols // group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.dtype != torch.float32 or tuple(t.shape) != (q.shape[0], num_groups) or t.stride(1) != 1:
            raise ValueError(f"{op}: {name} must be float32 ({q.shape[0]}, {num_groups}), got {t.dtype} "
                             f"{tuple(t.shape)}")
    if zeros.stride() != scales.stride():
        raise ValueError(f"{op}: scales and zeros must share one layout")


def int_weight_matmul_triton(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                             group_size: int, bits: int) -> torch.Tensor:
    """(tokens, out) = x · Wᵀ for W = (u - zeros) · scales per group of `group_size` columns, u the unsigned values
    of q: (out, in / 2) for bits=4 (two per byte), (out, in) for bits=8."""
    check_int_matmul_args(x, q, scales, zeros, group_size, bits)
    num_tokens, num_rows = x.shape[0], q.shape[0]
    out = x.new_empty(num_tokens, num_rows)
    if num_tokens == 0 or num_rows == 0:
        return out
    grid = (triton.cdiv(num_tokens, BLOCK_M), triton.cdiv(num_rows, BLOCK_N))
    with device_scope(x):
        _int_matmul_kernel[grid](x, q, scales, zeros, out, num_tokens, num_rows, x.shape[1], group_size, x.stride(0),
                                 q.stride(0), scales.stride(0), out.stride(0), BITS=bits,
                                 IEEE=x.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def check_fp8_matmul_args(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, row_ids: torch.Tensor,
                          col_ids: torch.Tensor) -> None:
    op = "fp8_weight_matmul"
    if q.dim() != 2 or q.dtype != torch.float8_e4m3fn or q.stride(1) != 1:
        raise ValueError(f"{op}: q must be a 2-D float8_e4m3fn tensor with unit stride in its last dim")
    _check_x(op, x, q.shape[1])
    if scales.dtype != torch.float32 or scales.dim() != 2 or scales.stride(1) != 1:
        raise ValueError(f"{op}: scales must be a 2-D float32 tensor with unit stride in its last dim")
    if tuple(row_ids.shape) != (q.shape[0],) or tuple(col_ids.shape) != (q.shape[1],):
        raise ValueError(f"{op}: row_ids must be ({q.shape[0]},) and col_ids ({q.shape[1]},)")


def fp8_weight_matmul_triton(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, row_ids: torch.Tensor,
                             col_ids: torch.Tensor) -> torch.Tensor:
    """(tokens, out) = x · Wᵀ for W = q · scales[row_ids[n], col_ids[k]] (per tensor, channel or block scales)."""
    check_fp8_matmul_args(x, q, scales, row_ids, col_ids)
    num_tokens, num_rows = x.shape[0], q.shape[0]
    out = x.new_empty(num_tokens, num_rows)
    if num_tokens == 0 or num_rows == 0:
        return out
    grid = (triton.cdiv(num_tokens, BLOCK_M), triton.cdiv(num_rows, BLOCK_N))
    with device_scope(x):
        _fp8_matmul_kernel[grid](x, q.view(torch.uint8), scales, row_ids, col_ids, out, num_tokens, num_rows,
                                 x.shape[1], x.stride(0), q.stride(0), scales.stride(0), out.stride(0),
                                 IEEE=x.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out
