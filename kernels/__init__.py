"""LoRA compute. The worker uses one backend object (kernels/backend.py: `select_backend`), chosen at start-up; the free
functions here are the same products from tensors alone, for tests and scripts: `*_torch` (the reference; the
compiled CPU kernels for bfloat16 CPU tensors where those are built) and `*_triton`."""

from __future__ import annotations

import torch
from loraplex.kernels import cpu_ext
from loraplex.kernels.backend import BACKENDS, BackendError, LoRABackend, LoRABatchMeta, select_backend
from loraplex.kernels.checks import check_expand_args, check_shrink_args
from loraplex.kernels.lora_expand import column_alignment, launch_expand, lora_expand_triton
from loraplex.kernels.lora_shrink import launch_shrink, lora_shrink_triton, shrink_output
from loraplex.kernels.lora_torch import lora_expand_torch, lora_shrink_expand_torch, lora_shrink_torch
from loraplex.kernels.segment_tiles import plan_tiles

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
    """y += the expand of the shrink, as the Triton backend runs it: two launches, no fill, split-K planes summed by the
    expand (checked and planned from the tensors here: host reads the backend does not make)."""
    num_slices = slice_offsets.shape[0] - 1
    check_shrink_args(x, lora_a, seg_indptr, seg_slots, slot_ranks, num_slices)
    h_splits = shrink_output(x, lora_a)
    check_expand_args(
        y, h_splits[0], lora_b, seg_indptr, seg_slots, slot_ranks, slot_scales, slice_offsets, float32_h=True
    )
    tiles = plan_tiles(x.shape[0], seg_slots.shape[0])
    launch_shrink(x, lora_a, h_splits, seg_indptr, seg_slots, slot_ranks, num_slices, tiles)
    launch_expand(y, h_splits, lora_b, seg_indptr, seg_slots, slot_ranks, slot_scales, slice_offsets, tiles,
                  column_alignment(slice_offsets.tolist()))  # fmt: skip
