"""An adapter's tensors as TensorSpecs and raw buffers: how the Engine and the RPC client send tensors (the bytes go
as extra ZeroMQ frames, never pickled; the workers check every spec against its bytes), and how node 0 cuts them
per TP rank (--nnodes > 1)."""

from __future__ import annotations

import math
import warnings
from typing import Any

from loraplex.protocol.lora_shards import rank_cut
from loraplex.protocol.structs import TENSOR_DTYPES, TensorSpec


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


def read_adapter_dir(path: str, root: str | None) -> tuple[dict, list[TensorSpec], list[memoryview]]:
    """A PEFT directory as a config and raw tensor buffers: how node 0 sends a directory load to ranks on other nodes
    (--nnodes > 1), which then never read the path. `path` is resolved and checked by the registry; every file read
    here must resolve inside `root` too (symlinks included). ValueError says what is wrong."""
    import json
    import os

    import torch
    from safetensors.torch import load_file

    def inside(name: str) -> str | None:
        file_path = os.path.realpath(os.path.join(path, name))
        if root is not None and os.path.commonpath([file_path, root]) != root:
            raise ValueError(f"{name} resolves outside the allowed root")
        return file_path if os.path.isfile(file_path) else None

    config_path = inside("adapter_config.json")
    if config_path is None:
        raise ValueError(f"no adapter_config.json in {path!r}: not a LoRA adapter")
    try:
        with open(config_path) as f:
            config = json.load(f)
        weights_path = inside("adapter_model.safetensors")
        if weights_path is not None:
            tensors = load_file(weights_path)
        elif (weights_path := inside("adapter_model.bin")) is not None:
            tensors = torch.load(weights_path, map_location="cpu", weights_only=True)
        else:
            raise ValueError(f"no adapter_model.safetensors or adapter_model.bin in {path!r}")
    except (OSError, json.JSONDecodeError, RuntimeError) as e:  # safetensors and torch raise RuntimeError on bad files
        raise ValueError(f"cannot read the adapter in {path!r}: {e}") from e
    if not isinstance(config, dict) or not isinstance(tensors, dict):
        raise ValueError(f"{path!r} is not a PEFT adapter (adapter_config.json or the weights are malformed)")
    return config, *encode_tensors(tensors)


def cut_per_rank(specs: list[TensorSpec], buffers: list, tp_size: int) -> list[list[memoryview]]:
    """Each TP rank's part of each tensor as raw bytes, [tp_rank][tensor], by the rule the workers use
    (protocol/lora_shards.py); a rank's frames then match its cut of the specs' whole shapes. A buffer whose size
    is not its spec's goes whole to every rank, which refuses it on its size."""
    import torch

    per_rank: list[list[memoryview]] = [[] for _ in range(tp_size)]
    for spec, buffer in zip(specs, buffers, strict=True):
        data = memoryview(buffer).cast("B")
        item_size = TENSOR_DTYPES.get(spec.dtype, 0)
        fits = len(spec.shape) == 2 and min(spec.shape) > 0 and len(data) == math.prod(spec.shape) * item_size
        for tp_rank in range(tp_size):
            cut = rank_cut(spec.name, spec.shape, tp_rank, tp_size) if fits else None
            if cut is None:
                per_rank[tp_rank].append(data)
                continue
            dim, start, length = cut
            with warnings.catch_warnings():  # read-only frames: only read, then copied
                warnings.filterwarnings("ignore", "The given buffer is not writable")
                rows = torch.frombuffer(data, dtype=torch.uint8).view(spec.shape[0], -1)  # (rows, row bytes)
            width = 1 if dim == 0 else item_size  # bytes per step along the cut dim
            part = rows.narrow(dim, start * width, length * width).contiguous().reshape(-1)  # (bytes,)
            per_rank[tp_rank].append(memoryview(part.numpy()))
    return per_rank
