"""The model's elementwise ops (RMSNorm, SiLU-and-multiply), chosen once when the worker starts and bound by each layer
when it is built (vLLM's CustomOp idea): the compiled CPU kernels where the worker runs them (the `cpu` LoRA backend),
else torch ops. A layer calls the ops it was given and never asks which they are."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F


class ModelOps(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class TorchOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Statistics in fp32 whatever the model dtype, as the reference implementation does.
        x_fp32 = x.float()  # (tokens, hidden)
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x_fp32.to(x.dtype)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # (tokens, 2 * intermediate): [gate | up]
        return F.silu(gate) * up  # (tokens, intermediate)


class CPUKernelOps(TorchOps):
    """cpu_ext's one-pass kernels, with the same rounding as the torch ops (bfloat16 on the CPU)."""

    name = "cpu"

    def __init__(self, compiled: ModuleType):
        self.compiled = compiled

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and x.stride(1) == 1:  # the layout the kernel reads; any other goes through torch ops
            return self.compiled.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.compiled.silu_and_mul(gate_up)


def select_model_ops(cpu_kernels: ModuleType | None) -> ModelOps:
    """The ops for this worker: the CPU kernels its LoRA backend built (`LoRABackend.cpu_kernels`), else torch ops."""
    return TorchOps() if cpu_kernels is None else CPUKernelOps(cpu_kernels)


_current: ModelOps = TorchOps()


@contextlib.contextmanager
def model_ops(ops: ModelOps) -> Iterator[None]:
    """Layers built inside this block compute with `ops` (they read it once, in __init__), as tensor_parallel does
    for the shard."""
    global _current
    previous, _current = _current, ops
    try:
        yield
    finally:
        _current = previous


def current_ops() -> ModelOps:
    return _current
