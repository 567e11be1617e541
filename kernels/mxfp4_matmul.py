"""MXFP4 weight matmul in Triton: y = x · Wᵀ for one expert's weight stored as gpt-oss's checkpoints store it, the
codes and scales dequantized tile by tile inside the kernel (the weight is read from memory at 4.25 bits per value).

    w[n, k] = E2M1(code[n, k]) · 2^(scales[n, k // 32] - 127)

blocks (out, in / 2) uint8 holds two e2m1 codes per byte, input 2j in the low nibble and 2j + 1 in the high one;
scales (out, in / 32) uint8 one e8m0 exponent per block of 32 inputs. An e2m1 code (sign, 2 exponent bits with bias
1, 1 mantissa bit) moved into float16's sign, exponent and mantissa places reads as its value / 2^14 (the code 0.5
becomes a float16 subnormal), so decoding is integer ops and one bitcast, exact; the block's scale is a float32 built
from its exponent bits. Products accumulate in float32; the weight tile is cast to the activation dtype before the dot
(float32: IEEE products), as the dequantized weight's matmul would round it. Grid: (token blocks, row blocks).

One expert per launch: worker/layers/moe.py's ExpertsLinear calls it for each expert's rows on CUDA, writing into its
rows of the layer's output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.quant_matmul import BLOCK_K, BLOCK_M, BLOCK_N, _check_x, _dot
from loraplex.kernels.segment_tiles import device_scope

MXFP4_BLOCK = 32  # inputs per e8m0 scale


@triton.jit
def _mxfp4_matmul_kernel(
    x_ptr,
    blocks_ptr,
    scales_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_bn,
    stride_sn,
    stride_om,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x_mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=x_mask, other=0.0)
        w_mask = (rk[:, None] < K) & (rn[None, :] < N)
        rows = rn[None, :].to(tl.int64)
        byte = tl.load(blocks_ptr + rows * stride_bn + rk[:, None] // 2, mask=w_mask, other=0).to(tl.int32)
        code = (byte >> ((rk[:, None] % 2) * 4)) & 0xF  # (BLOCK_K, BLOCK_N)
        half_bits = ((code & 0x8) << 12) | ((code & 0x7) << 9)
        value = half_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0  # exact: e2m1 values
        exponent = tl.load(scales_ptr + rows * stride_sn + rk[:, None] // 32, mask=w_mask, other=127).to(tl.int32)
        # 2^(e - 127) as float32 bits: the exponent field itself; e = 0 is the subnormal 2^-127
        scale = tl.where(exponent == 0, 0x00400000, exponent << 23).to(tl.float32, bitcast=True)
        w = value * scale  # (BLOCK_K, BLOCK_N)
        acc += _dot(x.to(dtype), w.to(dtype), IEEE)
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(dtype), mask=out_mask)


def check_mxfp4_matmul_args(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                            out: torch.Tensor | None = None) -> None:  # fmt: skip
    op = "mxfp4_weight_matmul"
    if blocks.dim() != 2 or blocks.dtype != torch.uint8 or blocks.stride(1) != 1:
        raise ValueError(f"{op}: blocks must be a 2-D uint8 tensor (out, in / 2) with unit stride in its last dim")
    num_rows, num_cols = blocks.shape[0], 2 * blocks.shape[1]
    if num_cols % MXFP4_BLOCK:
        raise ValueError(f"{op}: {num_cols} inputs are not whole blocks of {MXFP4_BLOCK}")
    _check_x(op, x, num_cols)
    expected = (num_rows, num_cols // MXFP4_BLOCK)
    if scales.dtype != torch.uint8 or tuple(scales.shape) != expected or scales.stride(1) != 1:
        raise ValueError(f"{op}: scales must be uint8 {expected} with unit stride in its last dim, got {scales.dtype} "
                         f"{tuple(scales.shape)}")  # fmt: skip
    for name, t in (("blocks", blocks), ("scales", scales)):
        if t.device != x.device:
            raise ValueError(f"{op}: {name} must be on {x.device}, got {t.device}")
    if out is not None and (tuple(out.shape) != (x.shape[0], num_rows) or out.dtype != x.dtype
                            or out.device != x.device or out.stride(1) != 1):  # fmt: skip
        raise ValueError(f"{op}: out must be {x.dtype} ({x.shape[0]}, {num_rows}) on {x.device} with unit stride in "
                         f"its last dim, got {out.dtype} {tuple(out.shape)}")  # fmt: skip


def mxfp4_weight_matmul_triton(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                               out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """(tokens, out) = x · Wᵀ for W (out, in) in MXFP4: `blocks` (out, in / 2) e2m1 codes, `scales` (out, in / 32)
    e8m0 exponents; written into `out` when given (a row range of a larger output, say)."""
    check_mxfp4_matmul_args(x, blocks, scales, out)
    if out is None:
        out = x.new_empty(x.shape[0], blocks.shape[0])
    launch_mxfp4_matmul(x, blocks, scales, out)
    return out


def launch_mxfp4_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """The launch alone, on checked arguments (ExpertsLinear checks its shapes once, when it is built)."""
    num_tokens, num_rows = x.shape[0], blocks.shape[0]
    if num_tokens == 0 or num_rows == 0:
        return
    grid = (triton.cdiv(num_tokens, BLOCK_M), triton.cdiv(num_rows, BLOCK_N))
    with device_scope(x):
        _mxfp4_matmul_kernel[grid](x, blocks, scales, out, num_tokens, num_rows, x.shape[1], x.stride(0),
                                   blocks.stride(0), scales.stride(0), out.stride(0), IEEE=x.dtype == torch.float32,
                                   BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)  # fmt: skip
