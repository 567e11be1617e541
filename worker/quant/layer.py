"""QuantizedLinearWeights: one tensor-parallel linear's quantized weight, from its checkpoint tensors to its kernel.

A linear built while `quantized_linears(fmt)` is active gets one placeholder parameter per checkpoint tensor of the
format (`qweight`, `scales`, ...; per fused slice, as the loader expects them). Their loaders stage the full tensors;
once a linear has them all, each slice is decoded (formats.py), this rank's shard is cut (rows for a column-parallel
layer, columns for a row-parallel one, refused where it would split a group or block), the slices are stacked, the
kernel's layout is built once (matmul.py), and the staged tensors and placeholders are dropped."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from loraplex.worker.quant.formats import QuantFormat
from loraplex.worker.quant.matmul import QuantMatmul, build_matmul
from loraplex.worker.quant.weights import FloatWeight, IntWeight, QuantWeight
from torch import nn

_current: QuantFormat | None = None


@contextlib.contextmanager
def quantized_linears(fmt: QuantFormat | None) -> Iterator[None]:
    """Linears built inside this block read their weights in `fmt` (None: plain weights)."""
    global _current
    previous, _current = _current, fmt
    try:
        yield
    finally:
        _current = previous


def current_format() -> QuantFormat | None:
    return _current


def add_placeholders(layer: nn.Module, fmt: QuantFormat, stage: Callable[..., None]) -> None:
    """One empty parameter on `layer` per checkpoint tensor of `fmt`, whose loader is stage(name, param, tensor,
    shard_id): the loader finds each tensor's parameter by name, the layer keeps what it decodes from them."""
    for name in fmt.tensor_names:
        placeholder = nn.Parameter(torch.empty(0, device="cpu"), requires_grad=False)
        placeholder.weight_loader = functools.partial(stage, name)
        layer.register_parameter(name, placeholder)


def decode_shard(fmt: QuantFormat, layer: nn.Module, tensors: dict[int, dict[str, torch.Tensor]]) -> QuantWeight:
    """This rank's (out_per_rank, in_per_rank) weight of a linear with linear.py's size attributes, from each slice's
    full checkpoint tensors (slice -> tensor name -> tensor): rows of every slice for a column-parallel layer,
    columns for a row-parallel one (refused where they would split a group)."""
    shards = []
    for slice_id, size in enumerate(layer.output_sizes):
        full = fmt.decode(tensors[slice_id], size, layer.input_size)
        if layer.tp_mode == "column":
            num_rows = layer.output_sizes_per_rank[slice_id]
            shards.append(full.narrow_rows(layer.tp_rank * num_rows, num_rows))
        else:
            num_cols = layer.input_size_per_rank
            shards.append(full.narrow_cols(layer.tp_rank * num_cols, num_cols))
    return (IntWeight if isinstance(shards[0], IntWeight) else FloatWeight).cat_rows(shards)


class QuantizedLinearWeights:
    def __init__(self, layer: nn.Module, fmt: QuantFormat):
        self.layer = layer  # the linear's sizes and shard (linear.py's attributes)
        self.format = fmt
        self.device = torch.empty(0).device  # the layer is built under the target device and activation dtype
        self.dtype = torch.get_default_dtype()
        self.staged: dict[int, dict[str, torch.Tensor]] = {}  # slice -> tensor name -> full checkpoint tensor
        self.matmul: QuantMatmul | None = None
        add_placeholders(layer, fmt, self._stage)

    def _stage(self, name: str, _param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        self.staged.setdefault(shard_id or 0, {})[name] = loaded
        complete = [s for s in self.staged.values() if len(s) == len(self.format.tensor_names)]
        if len(complete) == self.layer.num_slices:
            self._build()

    def _build(self) -> None:
        self.matmul = build_matmul(decode_shard(self.format, self.layer, self.staged), self.device, self.dtype)
        self.staged.clear()
        for name in self.format.tensor_names:
            delattr(self.layer, name)

    @property
    def nbytes(self) -> int:
        return 0 if self.matmul is None else self.matmul.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)  # (tokens, out_per_rank)
