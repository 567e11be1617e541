"""The two shapes every quantized checkpoint format decodes into, whatever its packing: integer weights with scales
(and zero points) per group of input columns, and FP8 weights with scales per block. Both are (out, in) like a plain
weight, so tensor-parallel sharding is plain row/column narrowing (an integer shard must hold whole groups)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# Random weights (--load-format dummy) spread their stored values as a real checkpoint's are: a group's largest |w|
# sets its scale at about 2.75 standard deviations (128 Gaussian values), an FP8 block's at about 4 (128 x 128).
_INT_SPREAD = 2.75
_FP8_SPREAD = 4.0


def _dummy_scale(std: float, spread: float) -> float:
    """std / spread, rounded to bfloat16: exact in every dtype checkpoints store scales in (bf16, fp16, fp32)."""
    return torch.tensor(std / spread).bfloat16().item()


def _check_edges(what: str, start: int, num: int, total: int, step: int) -> None:
    """[start, start + num) of `total` may only be cut at multiples of `step` (the last piece may be short)."""
    if start % step or (num % step and start + num != total):
        raise ValueError(f"tensor parallelism splits a quantization {what} of {step}: this rank's {num} of {total} "
                         f"start at {start}; choose a --tp that divides the layer into whole {what}s")


@dataclass(frozen=True)
class IntWeight:
    """w[o, i] = (q[o, i] - zeros[o, g(i)]) · scales[o, g(i)] with g(i) = g_idx[i], or i // group_size without one.
    q is int8 for formats that store signed values, uint8 for unsigned ones; zeros None means 0."""

    q: torch.Tensor  # (out, in) int8 | uint8
    scales: torch.Tensor  # (out, groups) float32
    zeros: torch.Tensor | None  # (out, groups) int32
    g_idx: torch.Tensor | None  # (in,) int64: each column's group (GPTQ's act-order), else groups are contiguous
    group_size: int  # input columns per group (in for one group per row)
    bits: int

    @staticmethod
    def random(out_features: int, in_features: int, *, bits: int, group_size: int, zero_point: int | None,
               std: float, generator: torch.Generator) -> IntWeight:
        """Dequantized values ~ N(0, std) on the integer grid (clipped where a real group's range clips them), one
        scale everywhere, groups in column order. zero_point: the stored integer of 0 (unsigned storage around
        2**(bits-1), GPTQ's and AWQ's; 0: signed with zero points; None: signed, no zero points stored)."""
        half = 1 << (bits - 1)
        spread = half / _INT_SPREAD
        values = torch.randn(out_features, in_features, generator=generator).mul_(spread).round_()
        values.clamp_(-half, half - 1)  # (out, in)
        num_groups = -(-in_features // group_size)
        scales = torch.full((out_features, num_groups), _dummy_scale(std, spread))
        zeros = None if zero_point is None else torch.full((out_features, num_groups), zero_point, dtype=torch.int32)
        q = values.add_(zero_point or 0).to(torch.uint8 if zero_point else torch.int8)
        return IntWeight(q=q, scales=scales, zeros=zeros, g_idx=None, group_size=group_size, bits=bits)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def signed_offset(self) -> int:
        """What to add to q to make it unsigned: formats that store signed values center them on zero."""
        return 1 << (self.bits - 1) if self.q.dtype == torch.int8 else 0

    def group_index(self) -> torch.Tensor:
        """(in,) each column's group."""
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.q.shape[1], device=self.q.device) // self.group_size

    def narrow_rows(self, start: int, num: int) -> IntWeight:
        zeros = None if self.zeros is None else self.zeros.narrow(0, start, num)
        return replace(self, q=self.q.narrow(0, start, num), scales=self.scales.narrow(0, start, num), zeros=zeros)

    def narrow_cols(self, start: int, num: int) -> IntWeight:
        q = self.q.narrow(1, start, num)
        if self.g_idx is not None:  # groups are scattered: every group's scale stays, the columns take their index
            return replace(self, q=q, g_idx=self.g_idx.narrow(0, start, num))
        if self.scales.shape[1] == 1:  # one group per row
            return replace(self, q=q, group_size=num)
        _check_edges("group", start, num, self.q.shape[1], self.group_size)
        first, count = start // self.group_size, -(-num // self.group_size)
        zeros = None if self.zeros is None else self.zeros.narrow(1, first, count)
        return replace(self, q=q, scales=self.scales.narrow(1, first, count), zeros=zeros)

    def dequantize(self, rows: slice, dtype: torch.dtype) -> torch.Tensor:
        """(rows, in) in dtype, computed in float32."""
        groups = self.group_index()
        w = self.q[rows].float()
        if self.zeros is not None:
            w = w - self.zeros[rows][:, groups].float()
        return (w * self.scales[rows][:, groups]).to(dtype)

    @staticmethod
    def cat_rows(parts: list[IntWeight]) -> IntWeight:
        first = parts[0]
        for part in parts[1:]:
            if part.group_size != first.group_size or part.q.dtype != first.q.dtype or (part.zeros is None) != (
                first.zeros is None
            ):
                raise ValueError("the fused projections are quantized differently")
            if (part.g_idx is None) != (first.g_idx is None) or (
                part.g_idx is not None and not torch.equal(part.g_idx, first.g_idx)
            ):
                raise ValueError("the fused projections have different act-order group indices (g_idx)")
        zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
        return replace(first, q=torch.cat([p.q for p in parts]), scales=torch.cat([p.scales for p in parts]),
                       zeros=zeros)

    def to(self, device: torch.device) -> IntWeight:
        return replace(self, q=self.q.to(device), scales=self.scales.to(device),
                       zeros=None if self.zeros is None else self.zeros.to(device),
                       g_idx=None if self.g_idx is None else self.g_idx.to(device))


@dataclass(frozen=True)
class FloatWeight:
    """w[o, i] = q[o, i] · scales[row_ids[o], col_ids[i]]: a scale per block (per tensor and per channel become
    per-row scales). The explicit indices let a TP shard or a fused projection start anywhere inside a block.
    w8a8: the checkpoint quantizes activations to FP8 too (served so where torch._scaled_mm applies, scaled_mm.py)."""

    q: torch.Tensor  # (out, in) float8
    scales: torch.Tensor  # (row blocks, column blocks) float32
    row_ids: torch.Tensor  # (out,) int64
    col_ids: torch.Tensor  # (in,) int64
    w8a8: bool = False

    @staticmethod
    def blocked(q: torch.Tensor, scales: torch.Tensor, block_rows: int, block_cols: int,
                w8a8: bool = False) -> FloatWeight:
        num_rows, num_cols = q.shape
        return FloatWeight(q=q, scales=scales, row_ids=torch.arange(num_rows) // block_rows,
                           col_ids=torch.arange(num_cols) // block_cols, w8a8=w8a8)

    @staticmethod
    def random(out_features: int, in_features: int, *, block_rows: int, block_cols: int, std: float,
               generator: torch.Generator) -> FloatWeight:
        """Dequantized values ~ N(0, std) in FP8 with one scale everywhere, stored per (block_rows, block_cols)
        block as the format keeps them (a whole tensor, a row, a 128 x 128 tile)."""
        spread = FP8_MAX / _FP8_SPREAD
        values = torch.randn(out_features, in_features, generator=generator).mul_(spread)
        q = values.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # e4m3fn has no infinity: clip, never NaN
        scales = torch.full((-(-out_features // block_rows), -(-in_features // block_cols)), _dummy_scale(std, spread))
        return FloatWeight.blocked(q, scales, block_rows, block_cols)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def narrow_rows(self, start: int, num: int) -> FloatWeight:
        return replace(self, q=self.q.narrow(0, start, num), row_ids=self.row_ids.narrow(0, start, num))

    def narrow_cols(self, start: int, num: int) -> FloatWeight:
        return replace(self, q=self.q.narrow(1, start, num), col_ids=self.col_ids.narrow(0, start, num))

    def dequantize(self, rows: slice, dtype: torch.dtype) -> torch.Tensor:
        """(rows, in) in dtype, computed in float32."""
        return (self.q[rows].float() * self.scales[self.row_ids[rows]][:, self.col_ids]).to(dtype)

    @staticmethod
    def cat_rows(parts: list[FloatWeight]) -> FloatWeight:
        if any(not torch.equal(p.col_ids, parts[0].col_ids) for p in parts):
            raise ValueError("the fused projections are quantized differently")
        offsets = [0]
        for part in parts[:-1]:
            offsets.append(offsets[-1] + part.scales.shape[0])
        row_ids = torch.cat([p.row_ids + offset for p, offset in zip(parts, offsets, strict=True)])
        return replace(parts[0], q=torch.cat([p.q for p in parts]), scales=torch.cat([p.scales for p in parts]),
                       row_ids=row_ids)

    def to(self, device: torch.device) -> FloatWeight:
        return replace(self, q=self.q.to(device), scales=self.scales.to(device), row_ids=self.row_ids.to(device),
                       col_ids=self.col_ids.to(device))


QuantWeight = IntWeight | FloatWeight
