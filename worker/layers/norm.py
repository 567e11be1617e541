from __future__ import annotations

from types import ModuleType

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.cpu_kernels: ModuleType | None = None  # the compiled CPU kernels (bfloat16 on the CPU), set at start-up

    def use_cpu_kernels(self, compiled: ModuleType | None) -> None:
        self.cpu_kernels = compiled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels is not None and x.dim() == 2 and x.stride(1) == 1:
            return self.cpu_kernels.rms_norm(x, self.weight, self.eps)  # one pass, the same rounding as below
        # Statistics in fp32 whatever the model dtype, as the reference implementation does.
        x_fp32 = x.float()  # (tokens, hidden)
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_fp32.to(x.dtype)
