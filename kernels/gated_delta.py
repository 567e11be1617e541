"""Gated DeltaNet's token mixing in Triton, for a whole batch of requests in one launch per op: the causal depthwise
conv + silu with its state, and the gated delta rule. The arithmetic is worker/layers/gated_delta.py's (the torch form
these are tested against); every request's states are read from its slot and written back in place.

Requests are given by a table of (first row, new tokens, slot) per request, the varlen form; the decode form takes one
token per request (row i is request i) and only the slots, so a decode-only batch needs no table.

- causal_conv: one program per (request, block of channels) walks the request's tokens in tiles. A tile's output is
  the kernel's taps over the inputs before each token: rows of the request, or, before its first token, the columns
  of its conv state. The program reads the old state first and writes the new one (the last kernel - 1 inputs) last,
  so no other program reads what it overwrites.
- delta_rule: a fused recurrent loop, not the chunked form: one program per (request, value head, block of dv columns)
  holds its (dk, BLOCK_DV) slice of the state in float32 registers and steps through the request's tokens:
      q, k <- l2norm(q, k), q * dk^-1/2;   S <- exp(g) S;   d = beta (v - Sᵀk);   S <- S + k dᵀ;   o = Sᵀq
  (each key head serves a run of value_heads / key_heads consecutive value heads). A decode is one step; a prefill
  of n tokens is n dependent steps per program, so its time grows with the longest prompt in the batch, where the
  chunked form would do a chunk's tokens in a few matmuls. The state is rounded to its slot's dtype once, at the end.
Each launcher checks its arguments; tests/kernel_refs.py has the torch references with the same signatures."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraplex.kernels.checks import FLOAT_DTYPES
from loraplex.kernels.segment_tiles import device_scope

L2NORM_EPS = 1e-6  # worker/layers/gated_delta.py: l2norm
CONV_BLOCK_T = 16  # tokens per tile of the conv
CONV_BLOCK_C = 128  # channels per conv program
RULE_BLOCK_DV = 32  # value columns of the state per delta-rule program


@triton.jit
def _request(table_ptr, num_reqs, req, ONE_TOKEN: tl.constexpr):
    """(first row, tokens, slot) of request `req`: the table's columns, or row req, one token, slot table[req]."""
    if ONE_TOKEN:  # a constexpr: only one branch is compiled
        start = req.to(tl.int64)
        num_tokens = 1
        slot = tl.load(table_ptr + req).to(tl.int64)
    else:
        start = tl.load(table_ptr + req).to(tl.int64)
        num_tokens = tl.load(table_ptr + num_reqs + req)
        slot = tl.load(table_ptr + 2 * num_reqs + req).to(tl.int64)
    return start, num_tokens, slot


@triton.jit(do_not_specialize=["num_reqs"])
def _conv_kernel(
    x_ptr,
    state_ptr,
    weight_ptr,
    out_ptr,
    table_ptr,
    num_reqs,
    channels,
    stride_x,
    stride_state_slot,
    stride_state_channel,
    stride_weight,
    stride_out,
    KERNEL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ONE_TOKEN: tl.constexpr,
):
    # grid: (request, channel block)
    start, num_tokens, slot = _request(table_ptr, num_reqs, tl.program_id(0), ONE_TOKEN)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < channels
    state_row = state_ptr + slot * stride_state_slot + c * stride_state_channel  # (BC,) pointers to column 0
    state_dtype = state_ptr.dtype.element_ty
    weight_dtype = weight_ptr.dtype.element_ty
    for tile in range(0, num_tokens, BLOCK_T):
        t = tile + tl.arange(0, BLOCK_T)  # (BT,) token index in the request
        t_mask = t < num_tokens
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(KERNEL):
            src = t - (KERNEL - 1) + j  # (BT,) the input this tap reads; < 0: the state's column KERNEL - 1 + src
            in_x = (src >= 0)[:, None] & t_mask[:, None] & c_mask[None, :]
            in_state = (src < 0)[:, None] & t_mask[:, None] & c_mask[None, :]
            xs = tl.load(x_ptr + (start + src)[:, None] * stride_x + c[None, :], mask=in_x, other=0.0)
            old = tl.load(state_row[None, :] + (KERNEL - 1 + src)[:, None], mask=in_state, other=0.0)
            window = tl.where(in_x, xs.to(state_dtype), old)  # (BT, BC) as the torch form concatenates them
            w = tl.load(weight_ptr + c * stride_weight + j, mask=c_mask, other=0.0)  # (BC,)
            acc += window.to(weight_dtype).to(tl.float32) * w.to(tl.float32)[None, :]
        conv = acc.to(weight_dtype).to(tl.float32)  # the conv's output, rounded as conv1d returns it
        out = conv / (1.0 + tl.exp(-conv))
        tl.store(out_ptr + (start + t)[:, None] * stride_out + c[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=t_mask[:, None] & c_mask[None, :])  # fmt: skip
    # The new state: the last KERNEL - 1 inputs of window = old state ++ the request's tokens.
    s = tl.arange(0, BLOCK_S)
    src = num_tokens - (KERNEL - 1) + s  # (BS,)
    s_mask = (s < KERNEL - 1)[None, :] & c_mask[:, None]
    in_x = (src >= 0)[None, :] & s_mask
    xs = tl.load(x_ptr + (start + src)[None, :] * stride_x + c[:, None], mask=in_x, other=0.0)  # (BC, BS)
    old = tl.load(state_row[:, None] + (KERNEL - 1 + src)[None, :], mask=(src < 0)[None, :] & s_mask, other=0.0)
    new = tl.where(in_x, xs.to(state_dtype), old)
    tl.debug_barrier()  # every read of the old state (by any thread of this program) before the first write
    tl.store(state_row[:, None] + s[None, :], new, mask=s_mask)


@triton.jit(do_not_specialize=["num_reqs"])
def _delta_rule_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    out_ptr,
    table_ptr,
    num_reqs,
    heads_per_key,
    scale,
    stride_q_row,
    stride_q_head,
    stride_k_row,
    stride_k_head,
    stride_v_row,
    stride_v_head,
    stride_g_row,
    stride_beta_row,
    stride_state_slot,
    stride_state_head,
    stride_state_k,
    stride_out_row,
    stride_out_head,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    EPS: tl.constexpr,
    ONE_TOKEN: tl.constexpr,
):
    # grid: (request, value head, dv block)
    start, num_tokens, slot = _request(table_ptr, num_reqs, tl.program_id(0), ONE_TOKEN)
    head = tl.program_id(1)
    key_head = head // heads_per_key
    kd = tl.arange(0, BLOCK_DK)
    vd = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    kd_mask = kd < DK
    vd_mask = vd < DV
    s_mask = kd_mask[:, None] & vd_mask[None, :]
    state_ptrs = state_ptr + slot * stride_state_slot + head * stride_state_head + kd[:, None] * stride_state_k
    state_ptrs += vd[None, :]
    state = tl.load(state_ptrs, mask=s_mask, other=0.0).to(tl.float32)  # (BDK, BDV)
    for t in range(0, num_tokens):
        row = start + t
        q = tl.load(q_ptr + row * stride_q_row + key_head * stride_q_head + kd, mask=kd_mask, other=0.0)
        k = tl.load(k_ptr + row * stride_k_row + key_head * stride_k_head + kd, mask=kd_mask, other=0.0)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + EPS) * scale  # (BDK,)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + EPS)
        v = tl.load(v_ptr + row * stride_v_row + head * stride_v_head + vd, mask=vd_mask, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + row * stride_g_row + head).to(tl.float32))
        beta = tl.load(beta_ptr + row * stride_beta_row + head).to(tl.float32)
        state = state * decay
        delta = beta * (v - tl.sum(state * k[:, None], 0))  # (BDV,)
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], 0)  # (BDV,)
        tl.store(out_ptr + row * stride_out_row + head * stride_out_head + vd, out, mask=vd_mask)
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_mask)


# ---- launchers ------------------------------------------------------------------------------------------------------


def _check_table(op: str, table: torch.Tensor, device: torch.device) -> int:
    """The varlen table (3, reqs) int32 [first rows; new tokens; slots]; its number of requests."""
    if table.dim() != 2 or table.shape[0] != 3 or table.dtype != torch.int32 or not table.is_contiguous():
        raise ValueError(f"{op}: the request table must be a contiguous (3, reqs) int32 tensor, got "
                         f"{tuple(table.shape)} {table.dtype}")  # fmt: skip
    if table.device != device:
        raise ValueError(f"{op}: the request table must be on {device}, got {table.device}")
    return table.shape[1]


def _check_slots(op: str, slots: torch.Tensor, device: torch.device) -> None:
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64) or not slots.is_contiguous():
        raise ValueError(f"{op}: slots must be a contiguous 1-D int32 or int64 tensor, got {tuple(slots.shape)} "
                         f"{slots.dtype}")  # fmt: skip
    if slots.device != device:
        raise ValueError(f"{op}: slots must be on {device}, got {slots.device}")


def _check_float(op: str, name: str, t: torch.Tensor, dim: int, device: torch.device) -> None:
    if t.dim() != dim or t.dtype not in FLOAT_DTYPES or t.device != device or (t.numel() and t.stride(-1) != 1):
        raise ValueError(f"{op}: {name} must be a {dim}-D float tensor on {device} with unit stride in its last dim, "
                         f"got {tuple(t.shape)} {t.dtype} on {t.device}")  # fmt: skip


def check_conv_args(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor) -> None:
    op = "causal_conv"
    _check_float(op, "x", x, 2, x.device)
    _check_float(op, "conv_states", conv_states, 3, x.device)
    _check_float(op, "weight", weight, 2, x.device)
    channels, kernel = weight.shape
    if x.shape[1] != channels or conv_states.shape[1:] != (channels, kernel - 1):
        raise ValueError(f"{op}: x (tokens, {channels}) and conv_states (slots, {channels}, {kernel - 1}) must "
                         f"match weight {tuple(weight.shape)}, got {tuple(x.shape)} and "
                         f"{tuple(conv_states.shape)}")  # fmt: skip


def _launch_conv(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, table: torch.Tensor,
                 num_reqs: int, one_token: bool) -> torch.Tensor:  # fmt: skip
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # (tokens, channels)
    channels, kernel = weight.shape
    if num_reqs == 0 or channels == 0:
        return out
    with device_scope(x):
        _conv_kernel[(num_reqs, triton.cdiv(channels, CONV_BLOCK_C))](
            x, conv_states, weight, out, table, num_reqs, channels,
            x.stride(0), conv_states.stride(0), conv_states.stride(1), weight.stride(0), out.stride(0),
            KERNEL=kernel, BLOCK_T=CONV_BLOCK_T, BLOCK_C=CONV_BLOCK_C,
            BLOCK_S=max(2, triton.next_power_of_2(kernel - 1)), ONE_TOKEN=one_token, num_warps=4,
        )  # fmt: skip
    return out


def causal_conv_triton(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                       table: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """silu(causal depthwise conv) (tokens, channels) of x (tokens, channels), each request's rows after the inputs
    in its slot's conv_states (slots, channels, kernel - 1), which are left holding its last kernel - 1 inputs;
    weight (channels, kernel); table (3, reqs) int32: each request's first row, new tokens and slot."""
    check_conv_args(x, conv_states, weight)
    num_reqs = _check_table("causal_conv", table, x.device)
    return _launch_conv(x, conv_states, weight, table, num_reqs, one_token=False)


def causal_conv_decode_triton(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                              slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One token per request: x (reqs, channels), each request's state conv_states[slots[i]], updated in place."""
    check_conv_args(x, conv_states, weight)
    _check_slots("causal_conv_decode", slots, x.device)
    if slots.shape[0] != x.shape[0]:
        raise ValueError(f"causal_conv_decode: {x.shape[0]} rows of x but {slots.shape[0]} slots")
    return _launch_conv(x, conv_states, weight, slots, x.shape[0], one_token=True)


def check_delta_rule_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor) -> None:  # fmt: skip
    op = "delta_rule"
    device = v.device
    for name, t in (("q", q), ("k", k), ("v", v), ("state", state)):
        _check_float(op, name, t, 4 if name == "state" else 3, device)
    for name, t in (("g", g), ("beta", beta)):
        _check_float(op, name, t, 2, device)
    num_tokens, num_heads, dv = v.shape
    if q.shape != k.shape or q.shape[0] != num_tokens or num_heads % q.shape[1]:
        raise ValueError(f"{op}: q and k must be (tokens, key_heads, dk) with key_heads dividing the value heads, "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")  # fmt: skip
    if g.shape != (num_tokens, num_heads) or beta.shape != g.shape:
        raise ValueError(f"{op}: g and beta must be ({num_tokens}, {num_heads}), got {tuple(g.shape)}, "
                         f"{tuple(beta.shape)}")  # fmt: skip
    if state.shape[1:] != (num_heads, q.shape[2], dv):
        raise ValueError(f"{op}: state must be (slots, {num_heads}, {q.shape[2]}, {dv}), got {tuple(state.shape)}")


def _launch_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, table: torch.Tensor, num_reqs: int, one_token: bool) -> torch.Tensor:  # fmt: skip
    num_tokens, num_heads, dv = v.shape
    dk = q.shape[2]
    out = torch.empty(num_tokens, num_heads, dv, dtype=torch.float32, device=v.device)
    if num_reqs == 0 or num_heads == 0:
        return out
    block_dk = triton.next_power_of_2(dk)
    block_dv = min(RULE_BLOCK_DV, triton.next_power_of_2(dv))
    with device_scope(v):
        _delta_rule_kernel[(num_reqs, num_heads, triton.cdiv(dv, block_dv))](
            q, k, v, g, beta, state, out, table, num_reqs, num_heads // q.shape[1], dk**-0.5,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
            beta.stride(0), state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1),
            DK=dk, DV=dv, BLOCK_DK=block_dk, BLOCK_DV=block_dv, EPS=L2NORM_EPS, ONE_TOKEN=one_token,
            num_warps=4 if block_dk * block_dv <= 4096 else 8,
        )  # fmt: skip
    return out


def delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, table: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The gated delta rule over each request's tokens: q, k (tokens, key_heads, dk) before their l2 norm and scale,
    v (tokens, value_heads, dv), g, beta (tokens, value_heads), state (slots, value_heads, dk, dv) read from and
    written back to each request's slot; table (3, reqs) int32 as causal_conv_triton's -> out (tokens, value_heads,
    dv) float32."""
    check_delta_rule_args(q, k, v, g, beta, state)
    num_reqs = _check_table("delta_rule", table, v.device)
    return _launch_rule(q, k, v, g, beta, state, table, num_reqs, one_token=False)


def delta_rule_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One token per request (row i is request i, its state state[slots[i]]) -> out (reqs, value_heads, dv) float32."""
    check_delta_rule_args(q, k, v, g, beta, state)
    _check_slots("delta_rule_decode", slots, v.device)
    if slots.shape[0] != v.shape[0]:
        raise ValueError(f"delta_rule_decode: {v.shape[0]} rows but {slots.shape[0]} slots")
    return _launch_rule(q, k, v, g, beta, state, slots, v.shape[0], one_token=True)
