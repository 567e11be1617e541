from __future__ import annotations

import torch
from loraplex.worker.layers.ops import current_ops
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.ops = current_ops()  # bound at construction: the worker's choice, made once at start-up

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rmsnorm(x); with a residual, the pre-norm step (rmsnorm(x + residual), x + residual) in one op."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)  # (tokens, hidden)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1, and x * rsqrt(...) * (1 + w) is all taken in fp32
    before one rounding (Llama's rounds x first). That rounding is the fused kernels' Llama one, so this runs as torch
    ops on every device."""

    identity_weight = 0.0  # the stored weight that scales by one (--load-format dummy fills norms with it)
    weight_offset = 1.0  # what the stored weight is an offset from

    def __init__(self, dim: int, eps: float, *, with_weight: bool = True):
        """with_weight False: no weight, x * rsqrt(...) alone (Gemma 4's value norm and router norm)."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False) if with_weight else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Over the last dim; with a residual, (norm(x + residual), x + residual) as RMSNorm."""
        if residual is not None:
            residual = x + residual  # in the activations' dtype, as the reference adds
            return self.forward(residual), residual
        x_fp32 = x.float()  # (..., dim)
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is None:
            return x_fp32.to(x.dtype)
        return (x_fp32 * (self.weight_offset + self.weight.float())).to(x.dtype)


class Gemma4RMSNorm(GemmaRMSNorm):
    """Gemma 4's: the weight stored as the scale itself (x * rsqrt(...) * w, in fp32, one rounding)."""

    identity_weight = 1.0
    weight_offset = 0.0
