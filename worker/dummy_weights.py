"""Random weights for `--load-format dummy`: a model at a real checkpoint's shapes without its weight files.

Like HF's init: linear and embedding weights ~ N(0, initializer_range), biases 0, norm weights 1. Each tensor is drawn
from its own generator, seeded by the server seed and its name, at its full (unsharded) checkpoint shape and handed
to its weight_loader as a checkpoint tensor would be, so every TP degree holds the same model; a draw depends on the
device and dtype it is made in."""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
from torch import nn


class _Draw(NamedTuple):
    param: nn.Parameter
    shape: tuple[int, ...]  # the full checkpoint tensor's
    key: str  # seeds the draw: the parameter's name (and slice)
    shard_id: int | None  # the slice of a fused layer, for its weight_loader


@torch.no_grad()
def init_dummy_weights(model: nn.Module, std: float, seed: int) -> None:
    draws: list[_Draw] = []
    seen: set[int] = set()  # a tied weight is drawn once, under its first name
    for module_name, module in model.named_modules():
        is_norm = type(module).__name__.endswith("Norm")
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{module_name}.{param_name}"
            if is_norm or param_name == "bias":
                # A norm: the weight that scales by one (Gemma's stores an offset from 1: 0 there). A bias is
                # replicated or sharded alike: zero everywhere.
                param.fill_(getattr(module, "identity_weight", 1.0) if is_norm else 0.0)
            elif getattr(param, "weight_loader", None) is None:  # replicated: drawn at its own shape
                draws.append(_Draw(param, tuple(param.shape), name, None))
            else:
                num_slices = getattr(module, "num_slices", 1)
                for shard_id in range(num_slices) if num_slices > 1 else (None,):
                    draws.append(_Draw(param, module.full_shape(param, shard_id), f"{name}[{shard_id}]", shard_id))

    def draw(job: _Draw) -> torch.Tensor:
        # One 32-bit seed of (seed, name): the CPU generator keeps only 32 bits of what it is given.
        generator = torch.Generator(device=job.param.device).manual_seed(zlib.crc32(f"{seed}:{job.key}".encode()))
        return torch.randn(job.shape, generator=generator, dtype=job.param.dtype, device=job.param.device).mul_(std)

    # A generator draws on one CPU thread: the tensors are drawn side by side (an 8B model's embedding and head alone
    # are a billion draws), then loaded in order.
    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
        for job, values in zip(draws, pool.map(draw, draws), strict=True):
            loader = getattr(job.param, "weight_loader", None)
            if loader is None:
                job.param.copy_(values)
            else:
                loader(job.param, values, job.shard_id)
