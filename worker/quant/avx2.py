"""Avx2IntMatmul: INT8 (per channel or per group) and INT4 (per group) weights on CPUs with AVX-512 BF16 or AVX2
(cpu_gemv.chosen_for_int), through kernels/cpu_gemv.py's kernels: the AVX-512 build for every row count, the AVX2 one
for up to 32 rows (a decode step) and torch's GEMM on dequantized tiles above that.

Whatever the checkpoint's packing (GPTQ, AWQ, compressed-tensors decode into an IntWeight, formats.py), the weight is
repacked once here into the one form the kernel streams: unsigned values (u = q + signed_offset) and per group a
float32 scale and bias with w = u · scale + bias (bias = -(zero + signed_offset) · scale), laid out by
cpu_gemv.pack_int for the build in use. Act-order groups are permuted into place once, as the torch path does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loraplex.kernels import cpu_gemv
from loraplex.worker.quant.weights import IntWeight, QuantWeight

TILE_ROWS = 512  # output rows dequantized at once for rows the AVX2 kernel does not take


def _act_order(weight: IntWeight) -> torch.Tensor | None:
    """The column order that makes act-order groups contiguous, if each group has exactly group_size columns."""
    order = torch.argsort(weight.g_idx, stable=True)
    expected = torch.arange(weight.q.shape[1], device=weight.g_idx.device) // weight.group_size
    return order if torch.equal(weight.g_idx[order], expected) else None


class Avx2IntMatmul:
    name = f"int weight-only ({getattr(cpu_gemv.isa(), 'name', 'AVX2')} decode kernel)"

    @staticmethod
    def fits(weight: QuantWeight, device: torch.device, dtype: torch.dtype) -> bool:
        if device.type != "cpu" or not isinstance(weight, IntWeight) or weight.bits not in (4, 8):
            return False
        if dtype not in (torch.float32, torch.bfloat16) or not cpu_gemv.chosen_for_int():
            return False
        if cpu_gemv.kernels() is None:  # the build failed (logged): torch's kernels
            return False
        cols, size = weight.q.shape[1], weight.group_size
        if size >= cols:  # one group per row (per channel): any width, tails included
            return weight.g_idx is None
        whole = size % cpu_gemv.group_multiple() == 0 and cols % size == 0
        return whole and (weight.g_idx is None or _act_order(weight) is not None)

    def __init__(self, weight: IntWeight, dtype: torch.dtype):
        self.order = None
        q, scales = weight.q, weight.scales
        zeros = None if weight.zeros is None else weight.zeros
        self.group_size = min(weight.group_size, q.shape[1])
        if weight.g_idx is not None:
            self.order = _act_order(weight)
            q = q[:, self.order]
            groups = weight.g_idx[self.order][:: self.group_size]
            scales = scales[:, groups]
            zeros = None if zeros is None else zeros[:, groups]
        offset = weight.signed_offset
        unsigned = (q.to(torch.int16) + offset).to(torch.uint8)  # (out, in)
        self.bits, self.cols = weight.bits, q.shape[1]
        zero = (0 if zeros is None else zeros.float()) + offset
        scales = scales.float()
        self.packed = cpu_gemv.pack_int(unsigned, scales, (-zero * scales).contiguous(), self.group_size, self.bits)
        self.dtype = dtype
        self.nbytes = self.packed.nbytes
        if self.order is not None:
            self.nbytes += self.order.numel() * self.order.element_size()

    def unsigned(self, rows: slice) -> torch.Tensor:
        """(rows, in) uint8 values."""
        return self.packed.unpack(rows)

    def dequantize(self, rows: slice, dtype: torch.dtype) -> torch.Tensor:
        """(rows, in) in dtype, computed in float32 as the kernel does."""
        u = self.unsigned(rows).float()
        scales, biases = self.packed.group_params(rows)
        num_rows, groups = scales.shape
        u = u.reshape(num_rows, groups, self.cols // groups)
        w = torch.addcmul(biases[:, :, None], u, scales[:, :, None])
        return w.reshape(num_rows, self.cols).to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.order is not None:
            x = x.index_select(-1, self.order)
        if cpu_gemv.takes_rows(self.packed, x.shape[0]):  # bf16 activations meet the weight as they are, fp32 exactly
            return cpu_gemv.gemv(x, self.packed)
        num_rows = self.packed.out_features
        y = x.new_empty(x.shape[0], num_rows)
        for start in range(0, num_rows, TILE_ROWS):
            rows = slice(start, min(start + TILE_ROWS, num_rows))
            y[:, rows] = F.linear(x, self.dequantize(rows, x.dtype))
        return y
