"""Tensor-parallel state for the layers: which shard a layer being built holds, and the all-reduce."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInfo:
    rank: int
    world_size: int


_current = TPInfo(rank=0, world_size=1)


@contextlib.contextmanager
def tensor_parallel(rank: int, world_size: int) -> Iterator[None]:
    """Layers built inside this block hold shard `rank` of `world_size` (they read it once, in __init__)."""
    global _current
    if not 0 <= rank < world_size:
        raise ValueError(f"tensor-parallel rank {rank} outside 0..{world_size - 1}")
    previous, _current = _current, TPInfo(rank=rank, world_size=world_size)
    try:
        yield
    finally:
        _current = previous


def current_tp() -> TPInfo:
    return _current


def all_reduce(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """Sum x over the tensor-parallel group (the default process group), in place."""
    if world_size > 1:
        dist.all_reduce(x)
    return x
