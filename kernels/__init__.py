"""LoRA compute. The worker uses one backend object (kernels/backend.py: `select_backend`), chosen at start-up; the free
functions here are the same products from tensors alone, for tests and scripts: `*_torch` (the reference; the
compiled CPU kernels for bfloat16 CPU tensors where those are built) and `*_triton`."""

from __future__ import annotations

import torch

from kernels import cpu_ext
from kernels.backend import BACKENDS, BackendError, LoRABackend, LoRABatchMeta, select_backend
from kernels.lora_expand import lora_expand_triton
from kernels.lora_shrink import lora_shrink_triton
from kernels.lora_torch import lora_expand_torch, lora_shrink_expand_torch, lora_shrink_torch

__all__ = [
    "BACKENDS",
    "BackendError",
    "LoRABackend",
    "LoRABatchMeta",
    "cpu_ext",
    "lora_expand_torch",
    "lora_expand_triton",
    "lora_shrink_expand_torch",
    "lora_shrink_expand_triton",
    "lora_shrink_torch",
    "lora_shrink_triton",
    "select_backend",
]


def lora_shrink_expand_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scales: torch.Tensor,
    slice_offsets: torch.Tensor,
) -> None:
    """lora_expand_triton(y, lora_shrink_triton(x, ...), ...): two launches."""
    h = lora_shrink_triton(x, lora_a, seg_indptr, seg_slots, slot_ranks, slice_offsets.shape[0] - 1)
    lora_expand_triton(y, h, lora_b, seg_indptr, seg_slots, slot_ranks, slot_scales, slice_offsets)
