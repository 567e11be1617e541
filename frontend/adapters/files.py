"""An adapter's files and tensors as the frontend handles them: a start-up adapter's config (to size the pool),
a directory read into TensorSpecs and raw buffers on node 0 (--nnodes > 1, so ranks on other nodes never open a
path) and cut per TP rank, and the Engine's and the RPC client's torch tensors as specs and buffers (the bytes go as
extra ZeroMQ frames, never pickled; the workers check every spec against its bytes). Files are found and opened by
protocol/adapters/adapter_files.py and configs parsed by protocol/adapters/adapter_config.py, as the workers do."""

from __future__ import annotations

import math
import warnings
from typing import Any

from loraplex.protocol.adapters.adapter_config import AdapterConfig, AdapterLoadError, parse_adapter_config
from loraplex.protocol.adapters.adapter_files import AdapterFiles
from loraplex.protocol.adapters.lora_shards import rank_cut
from loraplex.protocol.structs import TENSOR_DTYPES, TensorSpec


def read_adapter_config(lora_name: str, path: str, root: str | None = None) -> AdapterConfig:
    """A directory's adapter_config.json, parsed; AdapterLoadError says what is wrong."""
    return parse_adapter_config(AdapterFiles.under(lora_name, root).read_config(path))


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


def read_adapter_dir(path: str, root: str | None,
                     lora_name: str = "") -> tuple[dict, list[TensorSpec], list[memoryview]]:
    """A PEFT directory as its config and raw tensor buffers: how node 0 sends a directory load to ranks on other
    nodes (--nnodes > 1). Every file is opened inside `root` and checked on the open file, as a worker does; the
    config is sent as it is and parsed by each rank. AdapterLoadError says what is wrong."""
    config, tensors = read_adapter_tensors(path, root, lora_name)
    return config, *encode_tensors(tensors)


def read_adapter_tensors(path: str, root: str | None, lora_name: str = "") -> tuple[dict, dict[str, Any]]:
    """A PEFT directory's config (as written) and its torch tensors by key, every file opened inside `root`;
    AdapterLoadError says what is wrong."""
    import torch
    from safetensors.torch import load_file

    files = AdapterFiles.under(lora_name, root)
    config = files.read_config(path)
    weights_path = files.weights_path(path)
    try:
        with files.open(weights_path) as (file, opened_path):
            if weights_path.endswith(".safetensors"):
                tensors = load_file(opened_path)
            else:
                tensors = torch.load(file, map_location="cpu", weights_only=True)
    except AdapterLoadError:
        raise
    except Exception as e:  # a truncated or foreign file: safetensors, pickle and zip errors have no common type
        raise AdapterLoadError(f"cannot read the adapter weights in {path!r}: {type(e).__name__}: {e}") from e
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise AdapterLoadError(f"{weights_path!r} does not hold a dict of tensors")
    return config, tensors


def cut_per_rank(specs: list[TensorSpec], buffers: list, tp_size: int) -> list[list[memoryview]]:
    """Each TP rank's part of each tensor as raw bytes, [tp_rank][tensor], by the rule the workers use
    (protocol/adapters/lora_shards.py); a rank's frames then match its cut of the specs' whole shapes. A buffer whose
    size is not its spec's goes whole to every rank, which refuses it on its size."""
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
