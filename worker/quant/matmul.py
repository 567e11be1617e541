"""x · Wᵀ for one quantized weight, the kernel chosen once at load from the weight's form and the device:

  Int8ChannelMatmul  8-bit, one scale (and zero) per output row: torch's CPU int8 weight-only GEMM
                     (torch._weight_int8pack_mm); a zero point becomes a rank-1 correction
  Int4GroupMatmul    4-bit, groups of 32..256 contiguous columns (act-order ones permuted into place once):
                     torch's CPU int4 GEMM on its packed layout (torch._weight_int4pack_mm_for_cpu)
  DequantTileMatmul  anything else (FP8, grouped 8-bit, any weight on CUDA): the weight stays stored quantized and
                     is dequantized one tile of output rows at a time into the activation dtype

Each holds only its packed layout, built once here, and reports `nbytes` (the resident weight bytes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loraplex.worker.quant.weights import IntWeight, QuantWeight

TILE_ROWS = 512  # output rows dequantized at once
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU int4 kernel takes


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _signed_offset(weight: IntWeight) -> int:
    """What to add to q to make it unsigned: formats that store signed values center them on zero."""
    return 1 << (weight.bits - 1) if weight.q.dtype == torch.int8 else 0


class Int8ChannelMatmul:
    name = "int8 weight-only (torch CPU)"

    @staticmethod
    def fits(weight: QuantWeight, device: torch.device) -> bool:
        return (device.type == "cpu" and isinstance(weight, IntWeight) and weight.bits == 8
                and weight.scales.shape[1] == 1)

    def __init__(self, weight: IntWeight, dtype: torch.dtype):
        # w = (q - z)·s = (u - 128)·s + (128 - z')·s with u = q + offset unsigned and z' = z + offset: the first term
        # is the int8 GEMM on u - 128, the second a per-row bias scaled by each token's input sum.
        offset = _signed_offset(weight)
        unsigned = weight.q.to(torch.int16) + offset  # (out, in) in [0, 256)
        self.q = (unsigned - 128).to(torch.int8).contiguous()  # (out, in)
        self.scales = weight.scales[:, 0].to(dtype).contiguous()  # (out,)
        zeros = torch.zeros_like(weight.scales[:, 0]) if weight.zeros is None else weight.zeros[:, 0].float()
        correction = (128 - zeros - offset) * weight.scales[:, 0]  # (out,)
        self.correction = None if not correction.any() else correction.to(dtype)
        self.nbytes = _nbytes(self.q, self.scales, self.correction)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.contiguous(), self.q, self.scales)  # (tokens, out)
        if self.correction is not None:
            y = y + x.sum(-1, keepdim=True) * self.correction
        return y


class Int4GroupMatmul:
    name = "int4 weight-only (torch CPU)"

    @staticmethod
    def fits(weight: QuantWeight, device: torch.device) -> bool:
        if device.type != "cpu" or not isinstance(weight, IntWeight) or weight.bits != 4:
            return False
        num_cols = weight.q.shape[1]
        group_size = weight.group_size
        if group_size not in INT4_GROUP_SIZES or num_cols % group_size:
            return False
        return weight.g_idx is None or Int4GroupMatmul._permutation(weight) is not None

    @staticmethod
    def _permutation(weight: IntWeight) -> torch.Tensor | None:
        """The column order that makes act-order groups contiguous, if each group has exactly group_size columns."""
        order = torch.argsort(weight.g_idx, stable=True)
        expected = torch.arange(weight.q.shape[1], device=weight.g_idx.device) // weight.group_size
        return order if torch.equal(weight.g_idx[order], expected) else None

    def __init__(self, weight: IntWeight, dtype: torch.dtype):
        self.order = None if weight.g_idx is None else self._permutation(weight)
        q = weight.q if self.order is None else weight.q[:, self.order]
        groups = torch.arange(weight.scales.shape[1])
        if self.order is not None:  # after the permutation group g is columns [g·size, (g+1)·size)
            groups = weight.g_idx[self.order][:: weight.group_size]
        offset = _signed_offset(weight)
        unsigned = (q.to(torch.int32) + offset).contiguous()  # (out, in) in [0, 16)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(unsigned, 1)
        # The kernel computes (u - 8)·s + z per group: with w = (u - offset - zero)·s, z = (8 - offset - zero)·s.
        scales = weight.scales[:, groups]  # (out, groups)
        zeros = torch.zeros_like(scales) if weight.zeros is None else weight.zeros[:, groups].float()
        shift = (8 - offset - zeros) * scales
        self.scales_and_zeros = torch.stack([scales.t(), shift.t()], dim=-1).to(dtype).contiguous()  # (groups, out, 2)
        self.group_size = weight.group_size
        self.nbytes = _nbytes(self.packed, self.scales_and_zeros, self.order)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.order is not None:
            x = x.index_select(-1, self.order)
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group_size, self.scales_and_zeros)


class DequantTileMatmul:
    name = "dequantize per tile"

    def __init__(self, weight: QuantWeight, dtype: torch.dtype):
        self.weight, self.dtype = weight, dtype
        fields = ("q", "scales", "zeros", "g_idx", "row_ids", "col_ids")
        self.nbytes = _nbytes(*(getattr(weight, f, None) for f in fields))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = self.weight.shape[0]
        if num_rows <= TILE_ROWS:
            return F.linear(x, self.weight.dequantize(slice(None), self.dtype))
        y = x.new_empty(x.shape[0], num_rows)  # (tokens, out)
        for start in range(0, num_rows, TILE_ROWS):
            rows = slice(start, min(start + TILE_ROWS, num_rows))
            y[:, rows] = F.linear(x, self.weight.dequantize(rows, self.dtype))
        return y


QuantMatmul = Int8ChannelMatmul | Int4GroupMatmul | DequantTileMatmul


def build_matmul(weight: QuantWeight, device: torch.device, dtype: torch.dtype) -> QuantMatmul:
    weight = weight.to(device)
    for kernel in (Int8ChannelMatmul, Int4GroupMatmul):
        if kernel.fits(weight, device):
            return kernel(weight, dtype)
    return DequantTileMatmul(weight, dtype)
