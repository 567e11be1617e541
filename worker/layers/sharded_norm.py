"""RMSNorm over a tensor-parallel feature dimension: each rank holds some of the features (and their weights), and
the mean square is summed over ranks (OLMoE's q/k norm over the whole projection, whose heads TP splits)."""

from __future__ import annotations

import torch
from loraplex.worker.parallel import all_reduce, current_tp
from torch import nn


class ShardedRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        tp = current_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        if hidden_size % self.tp_size:
            raise ValueError(f"norm size {hidden_size} is not divisible by tp {self.tp_size}")
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.empty(hidden_size // self.tp_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: None = None) -> None:
        if tuple(loaded.shape) != (self.hidden_size,):
            raise ValueError(f"norm weight has shape {tuple(loaded.shape)}, expected ({self.hidden_size},)")
        size = self.hidden_size // self.tp_size
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()  # (tokens, features of this rank): statistics in fp32, as HF does
        square_sum = all_reduce(x_fp32.square().sum(-1, keepdim=True), self.tp_size)  # (tokens, 1)
        normed = x_fp32 * torch.rsqrt(square_sum / self.hidden_size + self.eps)
        return self.weight * normed.to(x.dtype)
