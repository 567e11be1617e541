"""Gated DeltaNet's token mixing as torch ops: the causal depthwise conv with its state, and the gated delta rule in
its recurrent form (decode: one token per request) and its chunked form (prefill), which compute the same thing.

The rule, per value head, with state S (key_head_dim, value_head_dim), q and k L2-normed, q scaled by dk^-1/2:
    S <- exp(g_t) S;   d_t = beta_t (v_t - S^T k_t);   S <- S + k_t d_t^T;   o_t = S^T q_t
Chunked form, within a chunk of positions i (G_i = g summed up to i in the chunk, S0 the state before it):
    (I + A) D = beta (V - exp(G) K S0),  A_ij = beta_i exp(G_i - G_j) k_i.k_j for j < i, else 0
    O = exp(G) Q S0 + (Q K^T * exp(G_i - G_j), j <= i) D;    S_end = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j d_j^T
so a chunk is a few matmuls and one triangular solve. Everything runs in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_LEN = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def conv_prefill(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (tokens, channels) of one request, state (channels, kernel - 1) before them, weight (channels, kernel):
    silu(causal conv) (tokens, channels); the state is left holding the last kernel - 1 inputs."""
    num_tokens = x.shape[0]
    window = torch.cat([state, x.t().to(state.dtype)], dim=-1)  # (channels, kernel - 1 + tokens)
    state.copy_(window[:, -state.shape[-1] :])
    out = F.conv1d(window.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])[0]
    return F.silu(out[:, -num_tokens:]).t().to(x.dtype)  # (tokens, channels)


def conv_decode(x: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One token per request: x (reqs, channels), their states conv_states[slots] (reqs, channels, kernel - 1),
    updated in place: silu(causal conv) (reqs, channels)."""
    window = torch.cat([conv_states[slots], x.unsqueeze(-1).to(conv_states.dtype)], dim=-1)  # (reqs, ch, kernel)
    conv_states[slots] = window[:, :, 1:]
    out = (window.to(weight.dtype) * weight).sum(-1)  # (reqs, channels)
    return F.silu(out).to(x.dtype)


def _expand_heads(x: torch.Tensor, num_value_heads: int) -> torch.Tensor:
    """(..., key_heads, dk) -> (..., value_heads, dk): each key head serves a run of consecutive value heads."""
    return x.repeat_interleave(num_value_heads // x.shape[-2], dim=-2)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One token each of a batch: q, k (reqs, key_heads, dk) normed and q scaled, v (reqs, value_heads, dv), g and
    beta (reqs, value_heads), state (reqs, value_heads, dk, dv) -> (out (reqs, value_heads, dv), new state).
    The state is read once for both of its products (with the old state: S'ᵀk = e^g Sᵀk, S'ᵀq = e^g Sᵀq +
    (k.q) d) and then updated in place when it is float32 (a copy otherwise), so a step makes three passes over it."""
    q, k = _expand_heads(q.float(), v.shape[-2]), _expand_heads(k.float(), v.shape[-2])  # (reqs, heads, dk)
    decay = g.float().exp()  # (reqs, heads)
    state = state if state.dtype == torch.float32 else state.float()
    reqs, heads, dk, dv = state.shape
    flat = state.view(reqs * heads, dk, dv)
    reads = torch.bmm(torch.stack([k, q], dim=-2).view(reqs * heads, 2, dk), flat).view(reqs, heads, 2, dv)
    k_read, q_read = reads[:, :, 0] * decay[..., None], reads[:, :, 1] * decay[..., None]  # (reqs, heads, dv)
    delta = (v.float() - k_read) * beta.float()[..., None]  # (reqs, heads, dv)
    out = q_read + (k * q).sum(-1, keepdim=True) * delta
    flat.mul_(decay.view(-1, 1, 1)).baddbmm_(k.reshape(-1, dk, 1), delta.reshape(-1, 1, dv))
    return out, state


def recurrent_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The recurrent form over one request's tokens (tokens lead each tensor, state (heads, dk, dv)): the reference
    the chunked form is tested against."""
    outs = []
    state = state.float().clone()  # recurrent_step updates a float32 state in place
    for t in range(q.shape[0]):
        out, state = recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1],
                                    state.unsqueeze(0))  # fmt: skip
        state = state[0]
        outs.append(out)
    return torch.cat(outs), state


def chunked_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, chunk_len: int = CHUNK_LEN) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One request's tokens: q, k (tokens, key_heads, dk) normed and q scaled, v (tokens, value_heads, dv), g, beta
    (tokens, value_heads), state (value_heads, dk, dv) -> (out (tokens, value_heads, dv), final state)."""
    num_heads = v.shape[-2]
    # heads first: (heads, tokens, d)
    q = _expand_heads(q.float(), num_heads).transpose(0, 1)
    k = _expand_heads(k.float(), num_heads).transpose(0, 1)
    v, g, beta = v.float().transpose(0, 1), g.float().t(), beta.float().t()
    state = state.float()
    outs = []
    for start in range(0, q.shape[1], chunk_len):
        end = min(start + chunk_len, q.shape[1])
        qc, kc, vc, bc = q[:, start:end], k[:, start:end], v[:, start:end], beta[:, start:end, None]
        cum = g[:, start:end].cumsum(-1)  # (heads, n): G
        n = end - start
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # (heads, n, n)
        lower = (bc * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)  # A
        system = lower + torch.eye(n, device=q.device)  # I + A
        rhs = bc * (vc - cum.exp()[..., None] * (kc @ state))  # (heads, n, dv)
        deltas = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # D
        outs.append(cum.exp()[..., None] * (qc @ state) + ((qc @ kc.transpose(-1, -2)) * decay) @ deltas)
        to_end = (cum[:, -1:] - cum).exp()[..., None]  # (heads, n, 1)
        state = cum[:, -1].exp()[:, None, None] * state + (kc * to_end).transpose(-1, -2) @ deltas
    return torch.cat(outs, dim=1).transpose(0, 1), state
