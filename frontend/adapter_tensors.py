"""An adapter's tensors as TensorSpecs and raw buffers: how the Engine and the RPC client send tensors (the bytes go
as extra ZeroMQ frames, never pickled; the workers check every spec against its bytes)."""

from __future__ import annotations

from typing import Any

from protocol.structs import TensorSpec


def encode_tensors(tensors: dict[str, Any]) -> tuple[list[TensorSpec], list[memoryview]]:
    """(one spec per tensor, its bytes: C order, little-endian) for a dict of torch tensors, in the dict's order."""
    import torch

    specs, buffers = [], []
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        specs.append(TensorSpec(name=name, dtype=str(tensor.dtype).removeprefix("torch."), shape=list(tensor.shape)))
        buffers.append(memoryview(flat.view(torch.uint8).numpy()))
    return specs, buffers
