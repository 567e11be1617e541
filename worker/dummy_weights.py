"""Random weights for `--load-format dummy`: a model at a real checkpoint's shapes without its weight files.

Like HF's init: linear and embedding weights ~ N(0, initializer_range), biases 0, norm weights 1. Each tensor is drawn
from its own generator, seeded by the server seed and its name, at its full (unsharded) checkpoint shape and handed
to its weight_loader as a checkpoint tensor would be, so every TP degree holds the same model; a draw depends on the
device and dtype it is made in.

A quantized linear (a checkpoint with a quantization_config) draws each projection's checkpoint tensors in the
format's own layout (formats.random_tensors: packed qweight/qzeros/scales/g_idx, FP8 weight and its scales, ...),
quantized MoE experts each expert's, whose dequantized values are ~ N(0, initializer_range) too; they are drawn on
the CPU in float32, where a real checkpoint's tensors are decoded, so they are the same on every device."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch
from loraplex.worker.quant.formats import QuantFormat, random_tensors
from torch import nn


class _Draw(NamedTuple):
    key: str  # seeds the draw: the parameter's (or quantized projection's) name and slice
    device: torch.device  # of the generator
    values: Callable[[torch.Generator], Any]  # the full checkpoint tensor(s), drawn from the generator
    load: Callable[[Any], None]  # hands them to the weight loaders


def _plain_draw(param: nn.Parameter, shape: tuple[int, ...], key: str, shard_id: int | None, std: float) -> _Draw:
    def values(generator: torch.Generator) -> torch.Tensor:
        draw = getattr(param, "random_checkpoint", None)  # packed codes and scales (MXFP4 experts): the format's
        if draw is not None:
            return draw(shape, std, generator)
        return torch.randn(shape, generator=generator, dtype=param.dtype, device=param.device).mul_(std)

    def load(full: torch.Tensor) -> None:
        loader = getattr(param, "weight_loader", None)
        if loader is None:  # replicated: drawn at its own shape
            param.copy_(full)
        else:
            loader(param, full, shard_id)

    return _Draw(key, param.device, values, load)


def _quantized_draw(module: nn.Module, fmt: QuantFormat, key: str, shard_id: int | tuple[int, int] | None,
                    out_features: int, in_features: int, std: float) -> _Draw:
    """One projection (a linear's slice, an expert's slice) of a quantized layer: its tensors staged through the
    placeholders' loaders, as the checkpoint loader stages them (the layer decodes and shards once it holds every
    slice)."""

    def values(generator: torch.Generator) -> dict[str, torch.Tensor]:
        return random_tensors(fmt, out_features, in_features, std, generator)

    def load(tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            placeholder = getattr(module, name)
            placeholder.weight_loader(placeholder, tensor, shard_id)

    return _Draw(key, torch.device("cpu"), values, load)


def _quantized_draws(module: nn.Module, module_name: str, fmt: QuantFormat, std: float) -> list[_Draw]:
    """Every projection of a quantized linear (per slice) or of quantized stacked experts (per expert and slice)."""
    if hasattr(module, "checkpoint_shards"):
        pieces = [((expert, slice_id), slice_id) for expert, slice_id in module.checkpoint_shards()]
    else:
        pieces = [(slice_id if module.num_slices > 1 else None, slice_id) for slice_id in range(module.num_slices)]
    return [_quantized_draw(module, fmt, f"{module_name}[{shard_id}]", shard_id, module.output_sizes[slice_id],
                            module.input_size, std) for shard_id, slice_id in pieces]  # fmt: skip


@torch.no_grad()
def init_dummy_weights(model: nn.Module, std: float, seed: int) -> None:
    draws: list[_Draw] = []
    seen: set[int] = set()  # a tied weight is drawn once, under its first name
    for module_name, module in model.named_modules():
        is_norm = type(module).__name__.endswith("Norm")
        # a quantized linear's, or quantized experts' (worker/layers/expert_weights.py), format
        quant = getattr(module, "quant", None) or getattr(module, "storage", None)
        fmt = getattr(quant, "format", None)
        quantized = () if fmt is None else fmt.tensor_names  # drawn per projection, below
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen or param_name in quantized:
                continue
            seen.add(id(param))
            name = f"{module_name}.{param_name}"
            if is_norm or param_name == "bias":
                # A norm: the weight that scales by one (Gemma's stores an offset from 1: 0 there). A bias is
                # replicated or sharded alike: zero everywhere.
                param.fill_(getattr(module, "identity_weight", 1.0) if is_norm else 0.0)
            elif (fill := getattr(param, "dummy_fill", None)) is not None:
                param.fill_(fill)  # a value that leaves the model as it would be without the parameter (bounds)
            elif getattr(param, "weight_loader", None) is None:
                draws.append(_plain_draw(param, tuple(param.shape), name, None, std))
            else:
                num_slices = getattr(module, "num_slices", 1)
                for shard_id in range(num_slices) if num_slices > 1 else (None,):
                    shape = module.full_shape(param, shard_id)
                    draws.append(_plain_draw(param, shape, f"{name}[{shard_id}]", shard_id, std))
        if fmt is not None:
            draws.extend(_quantized_draws(module, module_name, fmt, std))

    def draw(job: _Draw) -> Any:
        # One 32-bit seed of (seed, name): the CPU generator keeps only 32 bits of what it is given.
        return job.values(torch.Generator(device=job.device).manual_seed(zlib.crc32(f"{seed}:{job.key}".encode())))

    # A generator draws on one CPU thread: the tensors are drawn side by side (an 8B model's embedding and head alone
    # are a billion draws), then loaded in order.
    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
        for job, values in zip(draws, pool.map(draw, draws), strict=True):
            job.load(values)
