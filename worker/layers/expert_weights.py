"""How a stacked experts linear (moe.py's ExpertsLinear) holds its weights, one class per form. Each registers its
parameters on the layer under the names the loader reads, gives one expert's (out_per_rank, in_per_rank) weight in
the activation dtype to the layer's matmul loop (`expert_weight`), and counts the bytes it keeps (`resident_bytes`):

  PlainExpertWeights      `weight` (experts, out_per_rank, in_per_rank) in the activation dtype
  Mxfp4ExpertWeights      gpt-oss's MXFP4 codes and scales (worker/quant/mxfp4.py), from stacked checkpoint tensors
  QuantizedExpertWeights  a linear format of worker/quant/formats.py (FP8 in blocks, per channel or per tensor;
                          INT4/INT8 in groups: AWQ, GPTQ, compressed-tensors), from per-expert checkpoint tensors
                          (`experts.N.gate_proj.qweight`): each expert's tensors are staged, decoded and cut for this
                          rank as a quantized linear's are (worker/quant/layer.py's decode_shard), then kept stacked

Plain and MXFP4 weights are row tensors the layer's own weight_loader cuts. Quantized weights keep their checkpoint
precision: FP8 values with their block scales (any TP cut: each row and column keeps its block's index, as a dense
FP8 linear's does), or unsigned integers packed 32 // bits to an int32 word (worker/quant/packing.py) with scales and
zero points per group (a row-parallel cut inside a group is refused). Each expert is dequantized when its rows are
multiplied, by the formats' own dequantize."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from loraplex.worker.quant import mxfp4
from loraplex.worker.quant.formats import QuantFormat
from loraplex.worker.quant.layer import add_placeholders, decode_shard
from loraplex.worker.quant.packing import pack_int32, unpack_int32
from loraplex.worker.quant.weights import FloatWeight, IntWeight, QuantWeight
from torch import nn


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _num_rows(layer: nn.Module) -> int:
    return sum(layer.output_sizes_per_rank)


class PlainExpertWeights:
    def __init__(self, layer: nn.Module):
        self.layer = layer
        weight = torch.empty(layer.num_experts, _num_rows(layer), layer.input_size_per_rank)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader

    def expert_weight(self, expert: int) -> torch.Tensor:
        return self.layer.weight[expert]

    @property
    def resident_bytes(self) -> int:
        return _nbytes(self.layer.weight)


class Mxfp4ExpertWeights:
    """`blocks` (experts, out_per_rank, in_per_rank / 2) uint8 codes, `scales` (experts, out_per_rank, in_per_rank /
    32) uint8 exponents; --load-format dummy draws the format's bytes (worker/dummy_weights.py)."""

    def __init__(self, layer: nn.Module):
        if layer.input_size_per_rank % mxfp4.BLOCK_SIZE:
            raise ValueError(
                f"mxfp4 experts' {layer.input_size_per_rank} inputs per rank split a block of {mxfp4.BLOCK_SIZE}"
            )
        self.layer = layer
        self.dtype = torch.get_default_dtype()  # of the dequantized tiles
        num_blocks = layer.input_size_per_rank // mxfp4.BLOCK_SIZE
        shape = (layer.num_experts, _num_rows(layer))
        layer.blocks = self._param((*shape, num_blocks * mxfp4.BLOCK_SIZE // 2), mxfp4.random_blocks)
        layer.scales = self._param((*shape, num_blocks), mxfp4.random_scales)

    def _param(self, shape: tuple[int, ...], draw) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
        param.weight_loader = self.layer.weight_loader
        param.random_checkpoint = draw
        return param

    def expert_weight(self, expert: int) -> torch.Tensor:
        return mxfp4.dequantize(self.layer.blocks[expert], self.layer.scales[expert], self.dtype)

    @property
    def resident_bytes(self) -> int:
        return _nbytes(self.layer.blocks, self.layer.scales)


@dataclass
class StackedFloatWeights:
    """Every expert's FloatWeight at one shape: the row and column block indices are the same for every expert."""

    q: torch.Tensor  # (experts, out_per_rank, in_per_rank) float8
    scales: torch.Tensor  # (experts, row blocks, column blocks) float32
    row_ids: torch.Tensor  # (out_per_rank,) int64
    col_ids: torch.Tensor  # (in_per_rank,) int64

    @staticmethod
    def empty(first: FloatWeight, num_experts: int, device: torch.device) -> StackedFloatWeights:
        return StackedFloatWeights(
            q=torch.empty(num_experts, *first.q.shape, dtype=first.q.dtype, device=device),
            scales=torch.empty(num_experts, *first.scales.shape, device=device),
            row_ids=first.row_ids.to(device),
            col_ids=first.col_ids.to(device),
        )

    def put(self, expert: int, weight: QuantWeight) -> None:
        same = (isinstance(weight, FloatWeight) and weight.scales.shape == self.scales.shape[1:]
                and torch.equal(weight.row_ids.to(self.row_ids.device), self.row_ids)
                and torch.equal(weight.col_ids.to(self.col_ids.device), self.col_ids))  # fmt: skip
        if not same:
            raise ValueError(f"expert {expert} is quantized unlike the layer's other experts")
        self.q[expert].copy_(weight.q)
        self.scales[expert].copy_(weight.scales)

    def weight(self, expert: int) -> FloatWeight:
        return FloatWeight(q=self.q[expert], scales=self.scales[expert], row_ids=self.row_ids, col_ids=self.col_ids)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.q, self.scales, self.row_ids, self.col_ids)


@dataclass
class StackedIntWeights:
    """Every expert's IntWeight at one shape, its integers made unsigned (q + signed_offset) and packed along the
    input; zero points of the unsigned integers (the offset where the format stores none)."""

    qweight: torch.Tensor  # (experts, out_per_rank, in_per_rank * bits / 32) int32
    scales: torch.Tensor  # (experts, out_per_rank, groups) float32
    zeros: torch.Tensor  # (experts, out_per_rank, groups) uint8
    group_size: int
    bits: int

    @staticmethod
    def empty(first: IntWeight, num_experts: int, device: torch.device) -> StackedIntWeights:
        num_rows, num_cols = first.shape
        pack = 32 // first.bits
        if num_cols % pack:
            raise ValueError(
                f"{num_cols} inputs per rank do not fill whole int32 words of {pack} {first.bits}-bit values"
            )
        return StackedIntWeights(
            qweight=torch.empty(num_experts, num_rows, num_cols // pack, dtype=torch.int32, device=device),
            scales=torch.empty(num_experts, *first.scales.shape, device=device),
            zeros=torch.empty(num_experts, *first.scales.shape, dtype=torch.uint8, device=device),
            group_size=first.group_size,
            bits=first.bits,
        )

    def put(self, expert: int, weight: QuantWeight) -> None:
        if isinstance(weight, IntWeight) and weight.g_idx is not None:
            raise ValueError("experts quantized in act order (groups scattered by g_idx) are not supported")
        same = (isinstance(weight, IntWeight) and weight.bits == self.bits and weight.group_size == self.group_size
                and weight.scales.shape == self.scales.shape[1:])  # fmt: skip
        if not same:
            raise ValueError(f"expert {expert} is quantized unlike the layer's other experts")
        offset = weight.signed_offset
        self.qweight[expert].copy_(pack_int32(weight.q.to(torch.int16) + offset, self.bits, dim=1))
        self.scales[expert].copy_(weight.scales)
        if weight.zeros is None:
            self.zeros[expert].fill_(offset)
        else:
            self.zeros[expert].copy_(weight.zeros + offset)

    def weight(self, expert: int) -> IntWeight:
        q = unpack_int32(self.qweight[expert], self.bits, dim=1)  # (out_per_rank, in_per_rank) uint8
        return IntWeight(
            q=q,
            scales=self.scales[expert],
            zeros=self.zeros[expert].to(torch.int32),
            g_idx=None,
            group_size=self.group_size,
            bits=self.bits,
        )

    @property
    def nbytes(self) -> int:
        return _nbytes(self.qweight, self.scales, self.zeros)


class QuantizedExpertWeights:
    """One placeholder parameter per checkpoint tensor of the format (`weight` and `weight_scale_inv`, `qweight`,
    `weight_packed`, ...); their loaders take one (expert, slice) piece at a time (under expert parallelism, of the
    experts this rank holds; others are skipped). Once an expert has every slice,
    it is decoded and cut, and stored in the stacked form of its kind; once every expert is stored, the placeholders
    go."""

    def __init__(self, layer: nn.Module, fmt: QuantFormat):
        self.layer, self.format = layer, fmt
        self.device = torch.empty(0).device  # the layer is built under the target device and activation dtype
        self.dtype = torch.get_default_dtype()
        self.staged: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # expert -> slice -> tensor name -> tensor
        self.stacked: StackedFloatWeights | StackedIntWeights | None = None
        self.num_stored = 0
        add_placeholders(layer, fmt, self._stage)

    def _stage(self, name: str, _param: nn.Parameter, loaded: torch.Tensor,
               shard_id: tuple[int, int] | int | None) -> None:  # fmt: skip
        if not isinstance(shard_id, tuple):
            raise ValueError(
                f"experts in {self.format.description} are read per expert (experts.N.<proj>.{name}); "
                "a stacked experts tensor is not supported"
            )
        expert = shard_id[0] - self.layer.first_expert  # the checkpoint's expert id -> this rank's
        if not 0 <= expert < self.layer.num_experts:
            return  # expert parallelism: another rank holds it
        slice_id = shard_id[1]
        pieces = self.staged.setdefault(expert, {})
        pieces.setdefault(slice_id, {})[name] = loaded
        num_names = len(self.format.tensor_names)
        if len(pieces) == self.layer.num_slices and all(len(piece) == num_names for piece in pieces.values()):
            self._store(expert, decode_shard(self.format, self.layer, self.staged.pop(expert)))

    def _store(self, expert: int, weight: QuantWeight) -> None:
        if self.stacked is None:
            form = StackedFloatWeights if isinstance(weight, FloatWeight) else StackedIntWeights
            self.stacked = form.empty(weight, self.layer.num_experts, self.device)
        self.stacked.put(expert, weight)
        self.num_stored += 1
        if self.num_stored == self.layer.num_experts:
            self.drop_placeholders()

    def drop_placeholders(self) -> None:
        for name in self.format.tensor_names:
            delattr(self.layer, name)

    def expert_weight(self, expert: int) -> torch.Tensor:
        return self.stacked.weight(expert).dequantize(slice(None), self.dtype)

    @property
    def resident_bytes(self) -> int:
        return 0 if self.stacked is None else self.stacked.nbytes


ExpertWeights = PlainExpertWeights | Mxfp4ExpertWeights | QuantizedExpertWeights


def build_expert_weights(layer: nn.Module, fmt: QuantFormat | None) -> ExpertWeights:
    """The form `layer`'s experts are read in under the checkpoint's format (None: plain weights)."""
    if fmt is None:
        return PlainExpertWeights(layer)
    if fmt.experts_only:
        return Mxfp4ExpertWeights(layer)
    return QuantizedExpertWeights(layer, fmt)
