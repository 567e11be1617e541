"""RMSNorm, with the pre-norm residual add fused in, in Triton: one launch where torch ops take about seven.

    residual = x + residual          # in the activations' dtype, as the model adds
    out = weight * rmsnorm(residual)  # statistics in float32, normalized row rounded to the dtype, then scaled

Rounded exactly as the torch ops (worker/layers/ops.py: TorchOps; the reference in tests/kernel_refs.py): the sum is
rounded to the dtype before the norm reads it, the normalized row is rounded before the multiply by the weight.
One program per token row, the whole row in registers (hidden sizes up to MAX_HIDDEN)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.segment_tiles import device_scope

MAX_HIDDEN = 65536  # one row per program, in registers


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    hidden,
    eps,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    # grid: (tokens,)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded as the model adds
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / hidden + eps)
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    op = "rms_norm"
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{op}: x must be (tokens, hidden) with unit stride in its last dim, got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{op}: x must be float16, bfloat16 or float32, got {x.dtype}")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"{op}: weight must be contiguous ({x.shape[1]},) {x.dtype}, got {tuple(weight.shape)} "
                         f"{weight.dtype}")  # fmt: skip
    if weight.device != x.device:
        raise ValueError(f"{op}: weight must be on {x.device}, got {weight.device}")
    if x.shape[1] > MAX_HIDDEN:
        raise ValueError(f"{op}: hidden size {x.shape[1]} is over {MAX_HIDDEN}")
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device
        or residual.stride(1) != 1
    ):  # fmt: skip
        raise ValueError(f"{op}: residual must be {tuple(x.shape)} {x.dtype} on {x.device} with unit stride in its "
                         f"last dim, got {tuple(residual.shape)} {residual.dtype} on {residual.device}")  # fmt: skip


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor, residual_out: torch.Tensor | None) -> None:  # fmt: skip
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    block = triton.next_power_of_2(hidden)
    has_residual = residual is not None
    # absent tensors: x stands in for them (never read or written: HAS_RESIDUAL is a constexpr)
    residual, residual_out = (residual, residual_out) if has_residual else (x, x)
    with device_scope(x):
        _rms_norm_kernel[(num_tokens,)](
            x, residual, weight, out, residual_out, hidden, eps,
            x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
            BLOCK=block, HAS_RESIDUAL=has_residual, num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(tokens, hidden) weight * rmsnorm(x)."""
    check_rms_norm_args(x, weight)
    out = torch.empty_like(x)
    _launch(x, None, weight, eps, out, None)
    return out


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual), both (tokens, hidden) and new: the inputs are unchanged."""
    check_rms_norm_args(x, weight, residual)
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out
