"""SiLU-and-multiply of a fused [gate | up] projection in Triton: one launch where torch ops take two (the chunk is a
view; silu and the multiply each launch).

    out = silu(gate) * up

Rounded exactly as the torch ops (TorchOps: silu(gate) rounded to the dtype, then the product rounded).
Grid: (token, block of intermediate columns)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.segment_tiles import device_scope

BLOCK = 1024  # intermediate columns per program


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, intermediate, stride_gate_up, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate_ptrs = gate_up_ptr + row * stride_gate_up + cols
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + intermediate, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(dtype), mask=mask)


def check_silu_and_mul_args(gate_up: torch.Tensor) -> None:
    op = "silu_and_mul"
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 != 0 or gate_up.stride(1) != 1:
        raise ValueError(f"{op}: gate_up must be (tokens, 2 * intermediate) with unit stride in its last dim, got "
                         f"{tuple(gate_up.shape)}")  # fmt: skip
    if gate_up.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{op}: gate_up must be float16, bfloat16 or float32, got {gate_up.dtype}")


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """(tokens, intermediate) silu(gate) * up of (tokens, 2 * intermediate) [gate | up]."""
    check_silu_and_mul_args(gate_up)
    num_tokens, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(num_tokens, intermediate)
    if num_tokens == 0 or intermediate == 0:
        return out
    with device_scope(gate_up):
        _silu_mul_kernel[(num_tokens, triton.cdiv(intermediate, BLOCK))](
            gate_up, out, intermediate, gate_up.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4
        )
    return out
