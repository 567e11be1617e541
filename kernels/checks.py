from __future__ import annotations

import torch

# One argument contract for the torch reference and the Triton launchers, so a caller bug
# found on CPU is the same bug on GPU. Only metadata shapes are checked: values would need a device sync.

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_vector(op: str, name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if t.dim() != 1:
        raise ValueError(f"{op}: {name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{op}: {name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{op}: {name} must be on {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous")


def _check_matrix(op: str, name: str, t: torch.Tensor, dim: int, device: torch.device) -> None:
    if t.dim() != dim:
        raise ValueError(f"{op}: {name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {name} must be one of {FLOAT_DTYPES}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{op}: {name} must be on {device}, got {t.device}")


def _check_segments(
    op: str,
    device: torch.device,
    num_slots: int,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
) -> None:
    _check_vector(op, "seg_indptr", seg_indptr, torch.int32, device)
    _check_vector(op, "seg_slots", seg_slots, torch.int32, device)
    _check_vector(op, "slot_ranks", slot_ranks, torch.int32, device)
    if seg_indptr.shape[0] != seg_slots.shape[0] + 1:
        raise ValueError(
            f"{op}: seg_indptr must have num_segments + 1 = {seg_slots.shape[0] + 1} entries, got {seg_indptr.shape[0]}"
        )
    if slot_ranks.shape[0] != num_slots:
        raise ValueError(f"{op}: slot_ranks must have num_slots = {num_slots} entries, got {slot_ranks.shape[0]}")


def check_shrink_args(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    num_slices: int,
) -> int:
    op = "lora_shrink"
    _check_matrix(op, "x", x, 2, x.device)
    _check_matrix(op, "lora_a", lora_a, 3, x.device)
    if lora_a.dtype != x.dtype:
        raise ValueError(f"{op}: lora_a dtype {lora_a.dtype} must match x dtype {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"{op}: x must have unit stride in its last dim, got strides {x.stride()}")
    if not lora_a.is_contiguous():
        raise ValueError(f"{op}: lora_a must be contiguous")
    if lora_a.shape[2] != x.shape[1]:
        raise ValueError(f"{op}: lora_a in_dim {lora_a.shape[2]} must match x in_dim {x.shape[1]}")
    if num_slices < 1 or lora_a.shape[1] % num_slices != 0:
        raise ValueError(f"{op}: lora_a dim 1 ({lora_a.shape[1]}) must be num_slices ({num_slices}) * max_rank")
    _check_segments(op, x.device, lora_a.shape[0], seg_indptr, seg_slots, slot_ranks)
    return lora_a.shape[1] // num_slices


def check_expand_args(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scales: torch.Tensor,
    slice_offsets: torch.Tensor,
    row_scales: torch.Tensor | None = None,
    *,
    float32_h: bool = False,
) -> int:
    """float32_h: h may also be float32 (the Triton shrink's split-K planes, which the expand rounds as it reads);
    row_scales: None, or (tokens,) float32."""
    op = "lora_expand"
    _check_matrix(op, "y", y, 2, y.device)
    _check_matrix(op, "h", h, 2, y.device)
    _check_matrix(op, "lora_b", lora_b, 3, y.device)
    if (h.dtype != y.dtype and not (float32_h and h.dtype == torch.float32)) or lora_b.dtype != y.dtype:
        raise ValueError(f"{op}: h ({h.dtype}) and lora_b ({lora_b.dtype}) must match y dtype {y.dtype}")
    if y.stride(1) != 1 or h.stride(1) != 1:
        raise ValueError(f"{op}: y and h must have unit stride in their last dim")
    if not lora_b.is_contiguous():
        raise ValueError(f"{op}: lora_b must be contiguous")
    if h.shape[0] != y.shape[0]:
        raise ValueError(f"{op}: h has {h.shape[0]} rows but y has {y.shape[0]}")
    _check_vector(op, "slice_offsets", slice_offsets, torch.int32, y.device)
    num_slices = slice_offsets.shape[0] - 1
    if num_slices < 1 or h.shape[1] % num_slices != 0:
        raise ValueError(
            f"{op}: h dim 1 ({h.shape[1]}) must be num_slices ({num_slices}, from slice_offsets) * max_rank"
        )
    max_rank = h.shape[1] // num_slices
    if lora_b.shape[1] != max_rank or lora_b.shape[2] != y.shape[1]:
        raise ValueError(
            f"{op}: lora_b must be (num_slots, max_rank={max_rank}, out_dim={y.shape[1]}), got {tuple(lora_b.shape)}"
        )
    _check_segments(op, y.device, lora_b.shape[0], seg_indptr, seg_slots, slot_ranks)
    _check_vector(op, "slot_scales", slot_scales, torch.float32, y.device)
    if slot_scales.shape[0] != lora_b.shape[0]:
        raise ValueError(
            f"{op}: slot_scales must have num_slots = {lora_b.shape[0]} entries, got {slot_scales.shape[0]}"
        )
    if row_scales is not None:
        _check_vector(op, "row_scales", row_scales, torch.float32, y.device)
        if row_scales.shape[0] != y.shape[0]:
            raise ValueError(f"{op}: row_scales must have one entry per row of y ({y.shape[0]}), got {len(row_scales)}")
    return max_rank
