from __future__ import annotations

import torch
import torch.nn.functional as F
from loraplex.worker.layers.ops import current_ops
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up of a fused [gate | up] projection."""

    def __init__(self):
        super().__init__()
        self.ops = current_ops()  # bound at construction: the worker's choice, made once at start-up

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(gate_up)  # (tokens, 2 * intermediate) -> (tokens, intermediate)


class GeluTanhAndMul(nn.Module):
    """gelu(gate, tanh approximation) * up of a fused [gate | up] projection (Gemma's GeGLU); torch ops everywhere."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # (tokens, 2 * intermediate): [gate | up]
        return F.gelu(gate, approximate="tanh") * up  # (tokens, intermediate)


class ClampedSwiGLU(nn.Module):
    """gpt-oss's experts' activation over a [gate | up] projection: gate clamped to at most `limit`, up to
    [-limit, limit], then gate * sigmoid(alpha * gate) * (up + 1); torch ops everywhere."""

    def __init__(self, limit: float, alpha: float):
        super().__init__()
        self.limit, self.alpha = limit, alpha

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # (rows, 2 * intermediate): [gate | up]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)  # (rows, intermediate)

    def extra_repr(self) -> str:
        return f"limit={self.limit}, alpha={self.alpha}"
