"""x · Wᵀ for one quantized weight, the kernel chosen once at load from the weight's form and the device:

  Int8ChannelMatmul  8-bit, one scale (and zero) per output row: torch's CPU int8 weight-only GEMM
                     (torch._weight_int8pack_mm), or from 32 tokens on the activation dtype's GEMM on the weight
                     converted whole; a zero point becomes a rank-1 correction
  Int4GroupMatmul    4-bit, groups of 32..256 contiguous columns (act-order ones permuted into place once):
                     torch's CPU int4 GEMM on its packed layout (torch._weight_int4pack_mm_for_cpu)
  DequantTileMatmul  anything else (FP8 and grouped 8-bit on CPU, act-order shards whose groups are no longer
                     whole): the weight stays stored quantized and is dequantized one tile of output rows at a time
                     into the activation dtype
  TritonIntMatmul    on CUDA, INT4/INT8 in contiguous groups (act order permuted into place once): the weight read
                     packed and dequantized inside kernels/quant_matmul.py's kernel
  ScaledMMFP8Matmul  on CUDA with compute capability 8.9 and up, a W8A8 FP8 checkpoint with one scale per output row
                     or per tensor, bf16/fp16 activations: torch._scaled_mm on activations quantized on the fly
                     (scaled_mm.py)
  TritonFP8Matmul    on CUDA, any other FP8 weight (block scales, weight-only, sm_80, float32 activations): read and
                     dequantized inside kernels/quant_matmul.py's kernel

  Avx2IntMatmul      on CPUs with AVX-512 BF16 or AVX2, INT8/INT4 (per channel, or groups of 32·i / 8·i columns): the
                     skinny-matrix kernel of kernels/cpu_gemv.py up to 32 tokens, dequantized tiles above (avx2.py)

Each holds only its packed layout, built once here, and reports `nbytes` (the resident weight bytes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loraplex.kernels.quant_matmul import fp8_weight_matmul_triton, int_weight_matmul_triton
from loraplex.worker.quant.avx2 import Avx2IntMatmul
from loraplex.worker.quant.scaled_mm import ScaledMMFP8Matmul
from loraplex.worker.quant.weights import FloatWeight, IntWeight, QuantWeight

TILE_ROWS = 512  # output rows dequantized at once
# From this many tokens on, INT8 runs as the activation dtype's GEMM on the weight converted whole (oneDNN's bf16 GEMM
# beats torch's int8 kernel 1.2-2.5x at 32-512 tokens on an AVX512-BF16 CPU; below it the int8 kernel reads less).
INT8_GEMM_MIN_TOKENS = 32
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU int4 kernel takes


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _act_order(weight: IntWeight) -> torch.Tensor | None:
    """The column order that makes act-order groups contiguous, if each group has exactly group_size columns."""
    order = torch.argsort(weight.g_idx, stable=True)
    expected = torch.arange(weight.q.shape[1], device=weight.g_idx.device) // weight.group_size
    return order if torch.equal(weight.g_idx[order], expected) else None


def _has_contiguous_order(weight: IntWeight) -> bool:
    return weight.q.shape[1] % weight.group_size == 0 and (weight.g_idx is None or _act_order(weight) is not None)


def _contiguous_groups(weight: IntWeight) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(column order or None, q in that order (out, in), each contiguous group's index into scales/zeros)."""
    if weight.g_idx is None:
        return None, weight.q, torch.arange(weight.scales.shape[1], device=weight.q.device)
    order = _act_order(weight)  # after it group g is columns [g·size, (g+1)·size)
    return order, weight.q[:, order], weight.g_idx[order][:: weight.group_size]


class Int8ChannelMatmul:
    name = "int8 weight-only (torch CPU)"

    @staticmethod
    def fits(weight: QuantWeight, device: torch.device, dtype: torch.dtype) -> bool:
        return (device.type == "cpu" and isinstance(weight, IntWeight) and weight.bits == 8
                and weight.scales.shape[1] == 1)

    def __init__(self, weight: IntWeight, dtype: torch.dtype):
        # w = (q - z)·s = (u - 128)·s + (128 - z')·s with u = q + offset unsigned and z' = z + offset: the first term
        # is the int8 GEMM on u - 128, the second a per-row bias scaled by each token's input sum.
        offset = weight.signed_offset
        unsigned = weight.q.to(torch.int16) + offset  # (out, in) in [0, 256)
        self.q = (unsigned - 128).to(torch.int8).contiguous()  # (out, in)
        self.scales = weight.scales[:, 0].to(dtype).contiguous()  # (out,)
        zeros = torch.zeros_like(weight.scales[:, 0]) if weight.zeros is None else weight.zeros[:, 0].float()
        correction = (128 - zeros - offset) * weight.scales[:, 0]  # (out,)
        self.correction = None if not correction.any() else correction.to(dtype)
        self.nbytes = _nbytes(self.q, self.scales, self.correction)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= INT8_GEMM_MIN_TOKENS:  # q's integers are exact in bf16/fp16/fp32
            y = F.linear(x, self.q.to(x.dtype)) * self.scales  # (tokens, out)
        else:
            y = torch._weight_int8pack_mm(x.contiguous(), self.q, self.scales)
        if self.correction is not None:
            y = y + x.sum(-1, keepdim=True) * self.correction
        return y


class Int4GroupMatmul:
    name = "int4 weight-only (torch CPU)"

    @staticmethod
    def fits(weight: QuantWeight, device: torch.device, dtype: torch.dtype) -> bool:
        if device.type != "cpu" or not isinstance(weight, IntWeight) or weight.bits != 4:
            return False
        return weight.group_size in INT4_GROUP_SIZES and _has_contiguous_order(weight)

    def __init__(self, weight: IntWeight, dtype: torch.dtype):
        self.order, q, groups = _contiguous_groups(weight)
        offset = weight.signed_offset
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


class TritonIntMatmul:
    name = "int weight-only (Triton)"

    @staticmethod
    def fits(weight: QuantWeight, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and isinstance(weight, IntWeight) and _has_contiguous_order(weight)

    def __init__(self, weight: IntWeight, dtype: torch.dtype):
        self.order, q, groups = _contiguous_groups(weight)
        offset = weight.signed_offset
        unsigned = (q.to(torch.int16) + offset).to(torch.uint8)  # (out, in)
        self.bits, self.group_size = weight.bits, weight.group_size
        if self.bits == 4:  # columns 2j, 2j + 1 in byte j, low nibble first
            unsigned = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)
        self.q = unsigned.contiguous()
        self.scales = weight.scales[:, groups].contiguous()  # (out, groups) float32
        zeros = torch.zeros_like(self.scales) if weight.zeros is None else weight.zeros[:, groups].float()
        self.zeros = (zeros + offset).contiguous()  # of the unsigned values
        self.nbytes = _nbytes(self.q, self.scales, self.zeros, self.order)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.order is not None:
            x = x.index_select(-1, self.order)
        return int_weight_matmul_triton(x.contiguous(), self.q, self.scales, self.zeros, self.group_size, self.bits)


class TritonFP8Matmul:
    name = "fp8 weight-only (Triton)"

    @staticmethod
    def fits(weight: QuantWeight, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and isinstance(weight, FloatWeight)

    def __init__(self, weight: FloatWeight, dtype: torch.dtype):
        self.weight = weight
        self.nbytes = _nbytes(weight.q, weight.scales, weight.row_ids, weight.col_ids)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return fp8_weight_matmul_triton(x.contiguous(), w.q, w.scales, w.row_ids, w.col_ids)


QuantMatmul = (Avx2IntMatmul | Int8ChannelMatmul | Int4GroupMatmul | TritonIntMatmul | ScaledMMFP8Matmul
               | TritonFP8Matmul | DequantTileMatmul)
KERNELS = (Avx2IntMatmul, Int8ChannelMatmul, Int4GroupMatmul, TritonIntMatmul, ScaledMMFP8Matmul,
           TritonFP8Matmul)  # first fit wins


def choose_matmul(weight: QuantWeight, device: torch.device, dtype: torch.dtype) -> type[QuantMatmul]:
    """The kernel for `weight` on `device` with `dtype` activations (the weight may still be on the host)."""
    return next((kernel for kernel in KERNELS if kernel.fits(weight, device, dtype)), DequantTileMatmul)


def build_matmul(weight: QuantWeight, device: torch.device, dtype: torch.dtype) -> QuantMatmul:
    return choose_matmul(weight, device, dtype)(weight.to(device), dtype)
