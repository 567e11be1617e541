"""Load a Hugging Face safetensors checkpoint into a model, one file at a time, each parameter through its loader.

HF names map onto the fused layers: q_proj/k_proj/v_proj are slices 0/1/2 of qkv_proj, gate_proj/up_proj slices 0/1
of gate_up_proj; a checkpoint that stores them fused already (Phi-3: qkv_proj, gate_up_proj) loads each whole, and
the layer cuts every slice for this rank. Each parameter's `weight_loader` (if any) receives the full tensor and keeps
this rank's shard; the copy into the parameter converts the dtype and moves it to the device.
"""

from __future__ import annotations

import glob
import logging
import os

import torch
from loraplex.protocol.progress import Progress
from safetensors import safe_open
from torch import nn

logger = logging.getLogger(__name__)

# (HF module name, fused module name, slice)
FUSED_SLICES = (
    ("q_proj", "qkv_proj", 0),
    ("k_proj", "qkv_proj", 1),
    ("v_proj", "qkv_proj", 2),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)
# Checkpoint entries that are not parameters here (old checkpoints saved rotary tables).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    pass


def map_hf_name(hf_name: str) -> tuple[str, int | None]:
    """HF parameter name -> (our parameter name, slice of a fused layer or None)."""
    for hf_module, fused_module, slice_id in FUSED_SLICES:
        marker = f".{hf_module}."
        if marker in hf_name:
            return hf_name.replace(marker, f".{fused_module}."), slice_id
    return hf_name, None


def checkpoint_files(model_dir: str) -> list[str]:
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"model directory {model_dir!r} does not exist")
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir!r}")
    return files


def load_weights(model: nn.Module, model_dir: str, *, show_progress: bool = True) -> None:
    """show_progress: report tensors loaded (a bar on a terminal, else log lines); one rank of several says it."""
    params = dict(model.named_parameters())  # a tied weight appears once, under its first name
    aliases = set(dict(model.named_parameters(remove_duplicate=False))) - set(params)
    expected = {(name, None) for name in params}
    slices_of: dict[str, int] = {}  # fused parameter -> its number of slices
    for name, module in model.named_modules():
        num_slices = getattr(module, "num_slices", 1)
        if num_slices > 1:
            for suffix in ("weight", "bias"):
                if f"{name}.{suffix}" in params:
                    slices_of[f"{name}.{suffix}"] = num_slices
                    expected.discard((f"{name}.{suffix}", None))
                    expected.update((f"{name}.{suffix}", i) for i in range(num_slices))
    loaded: set[tuple[str, int | None]] = set()
    files = checkpoint_files(model_dir)
    total = sum(_num_tensors(path) for path in files)
    with Progress(logger, f"loading {model_dir}", total, "tensors", enabled=show_progress) as progress:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for hf_name in f.keys():
                    progress.update()
                    if hf_name.endswith(IGNORED_SUFFIXES):
                        continue
                    name, slice_id = map_hf_name(hf_name)
                    if name in aliases:
                        continue  # a tied weight: loaded under the name it is shared with
                    if name not in params:
                        logger.warning("ignoring checkpoint tensor %s: no such parameter", hf_name)
                        continue
                    _load_one(params[name], f.get_tensor(hf_name), slice_id, hf_name)
                    if slice_id is None and name in slices_of:  # stored fused (Phi-3): every slice at once
                        loaded.update((name, i) for i in range(slices_of[name]))
                    else:
                        loaded.add((name, slice_id))
    missing = sorted(f"{name}[{slice_id}]" if slice_id is not None else name for name, slice_id in expected - loaded)
    if missing:
        raise CheckpointError(f"checkpoint {model_dir!r} lacks {len(missing)} tensors, e.g. {', '.join(missing[:5])}")


def _num_tensors(path: str) -> int:
    with safe_open(path, framework="pt", device="cpu") as f:
        return len(f.keys())


@torch.no_grad()
def _load_one(param: nn.Parameter, tensor: torch.Tensor, slice_id: int | None, hf_name: str) -> None:
    loader = getattr(param, "weight_loader", None)
    try:
        if loader is not None:
            loader(param, tensor, slice_id)
        elif tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        else:
            param.data.copy_(tensor)
    except ValueError as e:
        raise CheckpointError(f"{hf_name}: {e}") from e
