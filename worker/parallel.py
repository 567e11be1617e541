"""Tensor-parallel state for the layers: which shard a layer being built holds, and the collectives (all-reduce,
all-to-all)."""

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
    # MoE layers' experts sharded by expert over the group (worker/layers/expert_parallel.py) instead of by rows
    expert_parallel: bool = False


_current = TPInfo(rank=0, world_size=1)


@contextlib.contextmanager
def tensor_parallel(rank: int, world_size: int, expert_parallel: bool = False) -> Iterator[None]:
    """Layers built inside this block hold shard `rank` of `world_size` (they read it once, in __init__)."""
    global _current
    if not 0 <= rank < world_size:
        raise ValueError(f"tensor-parallel rank {rank} outside 0..{world_size - 1}")
    previous, _current = _current, TPInfo(rank=rank, world_size=world_size, expert_parallel=expert_parallel)
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


def all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """Rows send_counts[0] of x to rank 0, the next send_counts[1] to rank 1, ...; returns the rows received,
    recv_counts[s] from rank s in rank order (gloo on CPU, NCCL on CUDA)."""
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts)
    return out
