"""The experts' grouped matmul in Triton: rows sorted by expert, each expert's rows times its own weight, in one launch
whose grid depends on shapes alone (no host read of the routing, so a CUDA graph can capture it).

    out[row] = rows[row] · W[e]ᵀ (+ bias[e])   for the rows expert_indptr[e] ... expert_indptr[e + 1]

Each program takes one row tile of one expert and one block of outputs: the tile numbering over experts is the LoRA
kernels' segment numbering (segment_tiles.py, the experts as segments), rebuilt in-kernel from the device offsets,
and spare programs exit at once. The weight is plain (experts, out, in) or MXFP4 (worker/quant/mxfp4.py: two e2m1
codes a byte, low nibble first, one e8m0 exponent per 32 inputs), dequantized tile by tile into the rows' dtype
before the dot, as the torch path dequantizes an expert before its matmul. Products accumulate in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.segment_tiles import device_scope, plan_tiles, segment_tile

BLOCK_N, BLOCK_K = 64, 32
MXFP4_BLOCK = 32  # inputs per e8m0 exponent


@triton.jit
def _e2m1(codes):
    """4-bit e2m1 codes (int32) to float32: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    magnitude = codes & 7
    exponent = magnitude >> 1
    mantissa = (magnitude & 1).to(tl.float32)
    normal = (1.0 + 0.5 * mantissa) * tl.where(exponent == 2, 2.0, tl.where(exponent == 3, 4.0, 1.0))
    value = tl.where(exponent == 0, 0.5 * mantissa, normal)
    return tl.where((codes & 8) != 0, -value, value)


@triton.jit
def _moe_matmul_kernel(x_ptr, w_ptr, scales_ptr, bias_ptr, out_ptr, expert_indptr_ptr, expert_ids_ptr, num_experts,
                       N, K, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
                       HAS_BIAS: tl.constexpr, MXFP4: tl.constexpr, SCALE_BLOCK: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SEG_BLOCK: tl.constexpr):  # fmt: skip
    # grid: (row tile, output block)
    expert, row_start, row_end = segment_tile(
        tl.program_id(0), expert_indptr_ptr, expert_ids_ptr, num_experts, BLOCK_M, SEG_BLOCK
    )
    if expert < 0:
        return
    dtype = out_ptr.dtype.element_ty
    rm = row_start + tl.arange(0, BLOCK_M)  # (BM,)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    row_mask, n_mask = rm < row_end, rn < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we + rn[None, :].to(tl.int64) * stride_wn  # (1, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)  # (BK,)
        k_mask = rk < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        w_mask = k_mask[:, None] & n_mask[None, :]
        if MXFP4:
            byte = tl.load(w_base + rk[:, None] // 2, mask=w_mask, other=0).to(tl.int32)  # (BK, BN)
            codes = (byte >> ((rk[:, None] % 2) * 4)) & 0xF
            s_ptrs = scales_ptr + expert.to(tl.int64) * stride_se + rn[None, :].to(tl.int64) * stride_sn
            exponent = tl.load(s_ptrs + rk[:, None] // SCALE_BLOCK, mask=w_mask, other=127).to(tl.int32)
            scale = (exponent << 23).to(tl.float32, bitcast=True)  # 2 ** (exponent - 127), exactly
            w = (_e2m1(codes) * scale).to(dtype)  # (BK, BN)
        else:
            w = tl.load(w_base + rk[:, None], mask=w_mask, other=0.0).to(dtype)  # (BK, BN)
        if IEEE:
            acc = tl.dot(x.to(dtype), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x.to(dtype), w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_be + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(dtype), mask=row_mask[:, None] & n_mask[None, :])


def check_moe_matmul_args(rows: torch.Tensor, weight: torch.Tensor, expert_indptr: torch.Tensor,
                          expert_ids: torch.Tensor, bias: torch.Tensor | None = None,
                          scales: torch.Tensor | None = None) -> None:  # fmt: skip
    """rows (rows, in) float; weight (experts, out, in) float, or MXFP4 codes (experts, out, in / 2) uint8 with
    scales (experts, out, in / 32) uint8; expert_indptr (experts + 1,) and expert_ids (experts,) int32 on the rows'
    device; bias (experts, out). Shapes only: values would need a device sync."""
    op = "moe_matmul"
    if rows.dim() != 2 or rows.dtype not in (torch.float16, torch.bfloat16, torch.float32) or rows.stride(1) != 1:
        raise ValueError(f"{op}: rows must be a 2-D float tensor with unit stride in its last dim")
    if weight.dim() != 3 or weight.stride(2) != 1:
        raise ValueError(f"{op}: weight must be 3-D (experts, out, in) with unit stride in its last dim")
    num_experts, num_out, num_in = weight.shape
    if scales is None:
        if weight.dtype != rows.dtype:
            raise ValueError(f"{op}: weight must be {rows.dtype} as the rows are, got {weight.dtype}")
    else:
        num_in = 2 * weight.shape[2]
        if weight.dtype != torch.uint8 or scales.dtype != torch.uint8 or scales.stride(2) != 1:
            raise ValueError(f"{op}: MXFP4 codes and scales must be uint8 with unit stride in their last dim")
        if tuple(scales.shape) != (num_experts, num_out, num_in // MXFP4_BLOCK) or num_in % MXFP4_BLOCK:
            raise ValueError(f"{op}: scales must be ({num_experts}, {num_out}, {num_in // MXFP4_BLOCK}), got "
                             f"{tuple(scales.shape)}")  # fmt: skip
    if rows.shape[1] != num_in:
        raise ValueError(f"{op}: rows have {rows.shape[1]} inputs, the weight {num_in}")
    for name, t, size in (("expert_indptr", expert_indptr, num_experts + 1), ("expert_ids", expert_ids, num_experts)):
        if t.dtype != torch.int32 or tuple(t.shape) != (size,) or t.device != rows.device or not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be a contiguous int32 ({size},) on {rows.device}")
    if bias is not None and (tuple(bias.shape) != (num_experts, num_out) or bias.stride(1) != 1):
        raise ValueError(f"{op}: bias must be ({num_experts}, {num_out}), got {tuple(bias.shape)}")


def moe_matmul_triton(
    rows: torch.Tensor,
    weight: torch.Tensor,
    expert_indptr: torch.Tensor,
    expert_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """(rows, out): each expert's rows times its weight (plus its bias); scales: the weight is MXFP4 codes."""
    check_moe_matmul_args(rows, weight, expert_indptr, expert_ids, bias, scales)
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    launch_moe_matmul(out, rows, weight, expert_indptr, expert_ids, bias, scales)
    return out


def launch_moe_matmul(
    out: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    expert_indptr: torch.Tensor,
    expert_ids: torch.Tensor,
    bias: torch.Tensor | None,
    scales: torch.Tensor | None,
) -> None:
    """The launch alone, on checked arguments, into `out` (rows, out) with unit stride in its last dim."""
    num_rows, num_in = rows.shape
    num_experts, num_out = weight.shape[:2]
    if num_rows == 0 or num_out == 0:
        return
    block_m, seg_block, num_tiles_bound = plan_tiles(num_rows, num_experts)
    grid = (num_tiles_bound, triton.cdiv(num_out, BLOCK_N))
    scale_args = (scales, scales.stride(0), scales.stride(1)) if scales is not None else (weight, 0, 0)
    with device_scope(rows):
        _moe_matmul_kernel[grid](
            rows, weight, scale_args[0], bias if bias is not None else weight, out, expert_indptr, expert_ids,
            num_experts, num_out, num_in, rows.stride(0), weight.stride(0), weight.stride(1), scale_args[1],
            scale_args[2], bias.stride(0) if bias is not None else 0, out.stride(0), HAS_BIAS=bias is not None,
            MXFP4=scales is not None,
        SCALE_BLOCK=MXFP4_BLOCK, IEEE=rows.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K, SEG_BLOCK=seg_block,
        )  # fmt: skip
