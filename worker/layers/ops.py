"""The model's elementwise ops (RMSNorm with its residual add, rotary embedding, SiLU-and-multiply), chosen once when
the worker starts and bound by each layer when it is built (vLLM's CustomOp idea): fused Triton kernels on CUDA, the
compiled CPU kernels where the worker runs them (the `cpu` LoRA backend), else torch ops. A layer calls the ops it was
given and never asks which they are. The torch ops are the reference the others round exactly as."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F
from loraplex.kernels.rms_norm import add_rms_norm_triton, rms_norm_triton
from loraplex.kernels.rotary import rotary_embedding_triton
from loraplex.kernels.silu_mul import silu_and_mul_triton


class ModelOps(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual): the pre-norm layer's residual add and norm. Inputs unchanged."""
        ...

    def rotary_embedding(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k rotated to their tokens' positions (rotate-half), from float32 (max_positions, head_dim) tables;
        q and k may be rotated in place."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def warmup(self, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, device: torch.device) -> int:  # fmt: skip
        """Run every op once on this shard's shapes so kernels compile before the first request; the launches."""
        ...


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class TorchOps:
    name = "torch"

    def __init__(self):
        # Every layer of a forward shares one positions tensor: their cos/sin rows, looked up once per forward.
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Statistics in fp32 whatever the model dtype, as the reference implementation does.
        x_fp32 = x.float()  # (tokens, hidden)
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x_fp32.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual  # (tokens, hidden), in the activations' dtype
        return self.rms_norm(residual, weight, eps), residual

    def rotary_embedding(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._rows  # one read: another model may share these ops (the default ones)
        if rows is None or rows[0] is not positions or rows[1] is not cos or rows[2] != q.dtype:
            # fp32 tables, cast to the activations' dtype at use, matching the reference's rounding.
            cos_rows = cos[positions].to(q.dtype).unsqueeze(1)  # (tokens, 1, head_dim)
            sin_rows = sin[positions].to(q.dtype).unsqueeze(1)
            self._rows = rows = (positions, cos, q.dtype, cos_rows, sin_rows)
        cos_rows, sin_rows = rows[3], rows[4]
        q = q * cos_rows + _rotate_half(q) * sin_rows  # (tokens, heads, head_dim)
        k = k * cos_rows + _rotate_half(k) * sin_rows  # (tokens, kv_heads, head_dim)
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # (tokens, 2 * intermediate): [gate | up]
        return F.silu(gate) * up  # (tokens, intermediate)

    def warmup(self, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, device: torch.device) -> int:  # fmt: skip
        return 0  # nothing compiles


class TritonOps:
    """The fused Triton kernels (kernels/rms_norm.py, rotary.py, silu_mul.py), on CUDA: one launch per op."""

    name = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_triton(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm_triton(x, residual, weight, eps)

    def rotary_embedding(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_embedding_triton(positions, q, k, cos, sin)  # in place

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_triton(gate_up)

    def warmup(self, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, device: torch.device) -> int:  # fmt: skip
        # The constexprs depend only on these sizes and the dtype, and no token count is specialized on: one batch
        # laid out as the model lays it out (q and k views of one qkv row) meets every variant serving meets.
        hidden = torch.zeros(1, hidden_size, dtype=dtype, device=device)
        weight = torch.ones(hidden_size, dtype=dtype, device=device)
        self.rms_norm(hidden, weight, 1e-6)
        self.add_rms_norm(hidden, hidden, weight, 1e-6)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        qkv = torch.zeros(1, q_size + 2 * kv_size, dtype=dtype, device=device)
        q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
        table = torch.zeros(1, head_dim, device=device)
        positions = torch.zeros(1, dtype=torch.long, device=device)
        self.rotary_embedding(positions, q.view(1, num_heads, head_dim), k.view(1, num_kv_heads, head_dim), table,
                              table)  # fmt: skip
        self.silu_and_mul(torch.zeros(1, 2 * intermediate_size, dtype=dtype, device=device))
        return 4


class CPUKernelOps(TorchOps):
    """cpu_ext's one-pass kernels, with the same rounding as the torch ops (bfloat16 on the CPU)."""

    name = "cpu"

    def __init__(self, compiled: ModuleType):
        super().__init__()
        self.compiled = compiled

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and x.stride(1) == 1:  # the layout the kernel reads; any other goes through torch ops
            return self.compiled.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.compiled.silu_and_mul(gate_up)


def select_model_ops(device: torch.device, cpu_kernels: ModuleType | None) -> ModelOps:
    """The ops for this worker: the Triton kernels on CUDA; on the CPU the CPU kernels its LoRA backend built
    (`LoRABackend.cpu_kernels`), else torch ops. Triton never runs on the CPU here (its interpreter is for tests)."""
    if device.type == "cuda":
        return TritonOps()
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
