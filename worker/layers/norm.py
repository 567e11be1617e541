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
