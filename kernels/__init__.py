"""LoRA compute. The worker uses one backend object (kernels/backend.py: `select_backend`), chosen at start-up; the
checked Triton launchers `*_triton` are the same products from tensors alone, for tests and scripts (their torch
references live in tests/kernel_refs.py). progress.py reports long start-up work (kernel builds, warm-ups; the
worker's checkpoint loading uses it too). kernels/ imports nothing of ours (tests/unit/test_package_boundaries.py)."""

from __future__ import annotations

from loraplex.kernels import cpu_ext
from loraplex.kernels.backend import BACKENDS, BackendError, LoRABackend, LoRABatchMeta, select_backend
from loraplex.kernels.lora_expand import lora_expand_triton
from loraplex.kernels.lora_shrink import lora_shrink_triton

__all__ = [
    "BACKENDS",
    "BackendError",
    "LoRABackend",
    "LoRABatchMeta",
    "cpu_ext",
    "lora_expand_triton",
    "lora_shrink_triton",
    "select_backend",
]
