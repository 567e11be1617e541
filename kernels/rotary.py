"""Rotary position embedding in Triton, in place on q and k: one launch where torch ops take about ten.

Rotate-half (neox) layout: with x = [x1 | x2] along head_dim and the tables' row at the token's position,
    out = [x1·cos - x2·sin | x2·cos + x1·sin]
The tables are the model's float32 (max_positions, head_dim) cos and sin (worker/layers/rotary.py: both halves of a
row equal), so every RoPE scaling the model supports is already in them. Rounded exactly as the torch ops (TorchOps:
the table rows cast to the activations' dtype, each product rounded, then the sum). One program per token, every
head of q and of k at once; the position is read on the device, so a captured CUDA graph replays any positions."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.segment_tiles import device_scope


@triton.jit
def _rotate_heads(x_ptr, stride_head, num_heads, cos, sin, half, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # x_ptr: this token's first head; cos, sin: (1, BLOCK_HALF) rounded to the dtype, in float32
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < half)
    first_ptrs = x_ptr + heads * stride_head + cols  # (BLOCK_H, BLOCK_HALF)
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(first_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first_ptrs, out1.to(dtype), mask=mask)
    tl.store(first_ptrs + half, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    num_q_heads,
    num_k_heads,
    half,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_table,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # grid: (tokens,)
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + position * stride_table + cols, mask=cols < half, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_table + cols, mask=cols < half, other=0.0).to(dtype).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_q_token, stride_q_head, num_q_heads, cos, sin, half, BLOCK_Q_HEADS,
                  BLOCK_HALF)  # fmt: skip
    _rotate_heads(k_ptr + token * stride_k_token, stride_k_head, num_k_heads, cos, sin, half, BLOCK_K_HEADS,
                  BLOCK_HALF)  # fmt: skip


def check_rotary_args(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    op = "rotary_embedding"
    if positions.dim() != 1 or positions.dtype not in (torch.int64, torch.int32) or positions.device != q.device:
        raise ValueError(f"{op}: positions must be 1-D int64 or int32 on {q.device}, got {tuple(positions.shape)} "
                         f"{positions.dtype} on {positions.device}")  # fmt: skip
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 3 or t.shape[0] != positions.shape[0] or t.stride(2) != 1:
            raise ValueError(f"{op}: {name} must be (tokens={positions.shape[0]}, heads, head_dim) with unit stride in "
                             f"its last dim, got {tuple(t.shape)}")  # fmt: skip
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32) or t.device != q.device:
            raise ValueError(f"{op}: {name} must be float16, bfloat16 or float32 on {q.device}, got {t.dtype}")
    if k.dtype != q.dtype or k.shape[2] != q.shape[2] or q.shape[2] % 2 != 0:
        raise ValueError(f"{op}: q and k must share their dtype and an even head_dim, got {q.dtype} {tuple(q.shape)} "
                         f"and {k.dtype} {tuple(k.shape)}")  # fmt: skip
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] != q.shape[2] or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be a contiguous float32 (max_positions, head_dim={q.shape[2]}) table, "
                             f"got {tuple(t.shape)} {t.dtype}")  # fmt: skip
        if t.device != q.device:
            raise ValueError(f"{op}: {name} must be on {q.device}, got {t.device}")
    if sin.shape != cos.shape:
        raise ValueError(f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape")


def rotary_embedding_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (tokens, heads, head_dim) and k (tokens, kv_heads, head_dim) rotated in place to their tokens' positions;
    returns them. Positions are not checked against the tables' length (that would read them back to the host)."""
    check_rotary_args(positions, q, k, cos, sin)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    with device_scope(q):
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos, sin, num_q_heads, k.shape[1], half,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            BLOCK_Q_HEADS=triton.next_power_of_2(num_q_heads), BLOCK_K_HEADS=triton.next_power_of_2(k.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
        )  # fmt: skip
    return q, k
