from __future__ import annotations

import os

import torch

from kernels import cpu_ext
from kernels.lora_expand import lora_expand_triton
from kernels.lora_shrink import lora_shrink_triton
from kernels.lora_torch import lora_expand_torch, lora_shrink_expand_torch, lora_shrink_torch

__all__ = [
    "cpu_ext",
    "lora_expand",
    "lora_expand_torch",
    "lora_expand_triton",
    "lora_shrink",
    "lora_shrink_expand",
    "lora_shrink_expand_torch",
    "lora_shrink_torch",
    "lora_shrink_triton",
]


def _use_triton(t: torch.Tensor) -> bool:
    # Read per call so tests can force the interpreter path after import.
    return t.is_cuda or os.environ.get("LORAPLEX_FORCE_TRITON") == "1"


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    num_slices: int,
) -> torch.Tensor:
    shrink = lora_shrink_triton if _use_triton(x) else lora_shrink_torch
    return shrink(x, lora_a, seg_indptr, seg_slots, slot_ranks, num_slices)


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scales: torch.Tensor,
    slice_offsets: torch.Tensor,
) -> None:
    expand = lora_expand_triton if _use_triton(y) else lora_expand_torch
    expand(y, h, lora_b, seg_indptr, seg_slots, slot_ranks, slot_scales, slice_offsets)


def lora_shrink_expand(
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
    """lora_expand(y, lora_shrink(x, ...), ...) in one call, fused where the backend can (the CPU kernels)."""
    if _use_triton(x):
        h = lora_shrink_triton(x, lora_a, seg_indptr, seg_slots, slot_ranks, slice_offsets.shape[0] - 1)
        lora_expand_triton(y, h, lora_b, seg_indptr, seg_slots, slot_ranks, slot_scales, slice_offsets)
    else:
        lora_shrink_expand_torch(y, x, lora_a, lora_b, seg_indptr, seg_slots, slot_ranks, slot_scales, slice_offsets)
