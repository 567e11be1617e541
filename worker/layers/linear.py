"""Tensor-parallel linear layers. Each forward is plain `x -> y`; each parameter carries a `weight_loader` that takes
the full Hugging Face tensor and keeps this rank's shard, so model code never sees the sharding.

What a wrapper (e.g. LoRA) can read from any of them:
  tp_mode            "column" (output dim sharded, output left sharded) or "row" (input dim sharded, output all-reduced)
                     or "replicated" (nothing sharded)
  tp_rank, tp_size   the shard this layer holds
  partial(x), finish(y)   forward(x) == finish(partial(x)); partial is this rank's product before any reduction, so a
                     wrapper can add its own per-rank term to it and share the layer's one all-reduce
  input_size         full input features;  input_size_per_rank = the columns of `weight` here
  output_sizes       full output features per fused slice (q, k, v / gate, up; one slice if not fused)
  output_sizes_per_rank, output_offsets_per_rank   each slice's rows in `weight` here
  weight             (sum(output_sizes_per_rank), input_size_per_rank);  bias  (sum(output_sizes_per_rank),) or None
  full_shape(param, shard_id)   the full checkpoint tensor weight_loader takes (random weights are drawn at it)
  quant              None, or for a quantized checkpoint (worker/quant/) the QuantizedLinearWeights that hold the
                     weight in its stored form and multiply by it; such a layer has no plain `weight`
"""

from __future__ import annotations

import itertools

import torch
from loraplex.kernels import cpu_gemv
from loraplex.worker.layers import packed
from loraplex.worker.parallel import TPInfo, all_reduce, current_tp
from loraplex.worker.quant.layer import QuantizedLinearWeights, current_format
from torch import nn


def _check_full_shape(name: str, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {expected}")


def _init_weight(layer: nn.Module, num_rows: int, num_cols: int) -> None:
    """The plain (num_rows, num_cols) weight, or the quantized checkpoint's tensors when one is being read."""
    fmt = current_format()
    layer.quant = None if fmt is None or fmt.experts_only else QuantizedLinearWeights(layer, fmt)
    if layer.quant is None:
        layer.weight = _empty_param(num_rows, num_cols)
        layer.weight.weight_loader = layer.weight_loader


def _matmul(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if layer.quant is not None:
        y = layer.quant(x)
        return y if bias is None else y + bias
    return packed.linear(x, layer.weight, layer.packed_weight, bias, layer.gemv)


def _empty_param(*shape: int) -> nn.Parameter:
    # Device and dtype come from the caller's defaults (the model is built under torch.device / default dtype).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's rows (the output features) split across ranks; each rank returns its slice of y."""

    tp_mode = "column"
    packed_weight: torch.Tensor | None = None  # set by packed.pack_linears (the CPU bfloat16 path)
    gemv: cpu_gemv.PackedWeight | None = None  # set by packed.use_gemv (the CPU bfloat16 decode kernel)

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False):
        super().__init__()
        self._init_slices(input_size, [output_size], bias)

    def _init_slices(self, input_size: int, output_sizes: list[int], bias: bool, tp: TPInfo | None = None) -> None:
        tp = tp or current_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        for size in output_sizes:
            if size % self.tp_size:
                raise ValueError(f"output size {size} of {type(self).__name__} is not divisible by tp {self.tp_size}")
        self.input_size = self.input_size_per_rank = input_size
        self.output_sizes = list(output_sizes)
        self.output_sizes_per_rank = [size // self.tp_size for size in output_sizes]
        self.output_offsets_per_rank = [0, *itertools.accumulate(self.output_sizes_per_rank)][:-1]
        _init_weight(self, sum(self.output_sizes_per_rank), input_size)
        self.bias = _empty_param(sum(self.output_sizes_per_rank)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    @property
    def num_slices(self) -> int:
        return len(self.output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """Copy this rank's rows of slice `shard_id` from the full checkpoint tensor; shard_id None: the tensor holds
        every slice, stacked in order (a checkpoint that stores q|k|v or gate|up fused, as Phi-3's), each cut on its
        own."""
        if shard_id is None and self.num_slices != 1:
            _check_full_shape(f"{type(self).__name__} (all slices)", loaded,
                              (sum(self.output_sizes), *loaded.shape[1:]))  # fmt: skip
            for slice_id, part in enumerate(loaded.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, slice_id)
            return
        slice_id = 0 if shard_id is None else shard_id
        _check_full_shape(f"{type(self).__name__} slice {slice_id}", loaded, self.full_shape(param, shard_id))
        num_rows = self.output_sizes_per_rank[slice_id]
        shard = loaded.narrow(0, self.tp_rank * num_rows, num_rows)
        param.data.narrow(0, self.output_offsets_per_rank[slice_id], num_rows).copy_(shard)

    def full_shape(self, param: nn.Parameter, shard_id: int | None = None) -> tuple[int, ...]:
        """The shape of the full checkpoint tensor weight_loader takes for `param`'s slice `shard_id`."""
        full_rows = self.output_sizes[0 if shard_id is None else shard_id]
        return (full_rows,) if param is self.bias else (full_rows, self.input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul(self, x, self.bias)  # (tokens, sum(output_sizes_per_rank))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)  # the output stays sharded: nothing to reduce

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, bias={self.bias is not None}, tp={self.tp_size}"


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (q|k|v, gate|up).
    Each slice is sharded on its own, so rank r holds [q_r | k_r | v_r]."""

    def __init__(self, input_size: int, output_sizes: list[int], *, bias: bool = False):
        nn.Module.__init__(self)
        self._init_slices(input_size, output_sizes, bias)


class ReplicatedLinear(ColumnParallelLinear):
    """y = x Wᵀ + b, the whole weight on every rank (latent attention's down-projections, whose output every rank's
    heads read). A LoRA adapter's A and B stay whole too."""

    tp_mode = "replicated"

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False):
        nn.Module.__init__(self)
        self._init_slices(input_size, [output_size], bias, tp=TPInfo(rank=0, world_size=1))


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's columns (the input features) split across ranks: x arrives sharded (the output of a
    column-parallel layer), the partial products are all-reduced, and the bias is added once after the reduction."""

    tp_mode = "row"
    packed_weight: torch.Tensor | None = None  # set by packed.pack_linears (the CPU bfloat16 path)
    gemv: cpu_gemv.PackedWeight | None = None  # set by packed.use_gemv (the CPU bfloat16 decode kernel)

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False):
        super().__init__()
        tp = current_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        if input_size % self.tp_size:
            raise ValueError(f"input size {input_size} of RowParallelLinear is not divisible by tp {self.tp_size}")
        self.input_size = input_size
        self.input_size_per_rank = input_size // self.tp_size
        self.output_sizes = self.output_sizes_per_rank = [output_size]
        self.output_offsets_per_rank = [0]
        _init_weight(self, output_size, self.input_size_per_rank)
        self.bias = _empty_param(output_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    num_slices = 1

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if param is self.bias:  # replicated: every rank holds it, only the reduced sum gets it added
            _check_full_shape("RowParallelLinear bias", loaded, self.full_shape(param))
            param.data.copy_(loaded)
            return
        _check_full_shape("RowParallelLinear weight", loaded, self.full_shape(param))
        num_cols = self.input_size_per_rank
        param.data.copy_(loaded.narrow(1, self.tp_rank * num_cols, num_cols))

    def full_shape(self, param: nn.Parameter, shard_id: int | None = None) -> tuple[int, ...]:
        """The shape of the full checkpoint tensor weight_loader takes for `param`."""
        return (self.output_sizes[0],) if param is self.bias else (self.output_sizes[0], self.input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul(self, x)  # (tokens, output_size): this rank's share of the sum

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        y = all_reduce(y, self.tp_size)  # (tokens, output_size)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes[0]}, bias={self.bias is not None}, tp={self.tp_size}"
