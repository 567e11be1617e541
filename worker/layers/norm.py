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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)  # (tokens, hidden)
