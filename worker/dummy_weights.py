"""Random weights for `--load-format dummy`: a model at a real checkpoint's shapes without its weight files.

Like HF's init: linear and embedding weights ~ N(0, initializer_range), biases 0, norm weights 1. Each tensor is drawn
from its own generator, seeded by the server seed and its name, at its full (unsharded) checkpoint shape and handed
to its weight_loader as a checkpoint tensor would be, so every TP degree holds the same model; a draw depends on the
device and dtype it is made in."""

from __future__ import annotations

import zlib

import torch
from torch import nn


@torch.no_grad()
def init_dummy_weights(model: nn.Module, std: float, seed: int) -> None:
    seen: set[int] = set()  # a tied weight is drawn once, under its first name
    for module_name, module in model.named_modules():
        is_norm = type(module).__name__.endswith("Norm")
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if is_norm or param_name == "bias":
                param.fill_(1.0 if is_norm else 0.0)  # a bias is replicated or sharded alike: zero everywhere
                continue
            name = f"{module_name}.{param_name}"
            loader = getattr(param, "weight_loader", None)
            if loader is None:  # replicated: drawn at its own shape
                param.copy_(_draw(param, tuple(param.shape), name, std, seed))
                continue
            num_slices = getattr(module, "num_slices", 1)
            for shard_id in range(num_slices) if num_slices > 1 else (None,):
                full = _draw(param, module.full_shape(param, shard_id), f"{name}[{shard_id}]", std, seed)
                loader(param, full, shard_id)


def _draw(param: nn.Parameter, shape: tuple[int, ...], key: str, std: float, seed: int) -> torch.Tensor:
    # One 32-bit seed of (seed, name): the CPU generator keeps only 32 bits of what it is given.
    generator = torch.Generator(device=param.device).manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
    return torch.randn(shape, generator=generator, dtype=param.dtype, device=param.device).mul_(std)
