"""Load a Hugging Face safetensors checkpoint into a model, one file at a time, each parameter through its loader.

HF names map onto the fused layers: q_proj/k_proj/v_proj are slices 0/1/2 of qkv_proj, gate_proj/up_proj slices 0/1
of gate_up_proj; a checkpoint that stores them fused already (Phi-3: qkv_proj, gate_up_proj) loads each whole, and
the layer cuts every slice for this rank. An MoE block's experts (`experts.N.w1/w3/w2` or
`experts.N.gate_proj/up_proj/down_proj`, or the stacked `experts.gate_up_proj`/`experts.down_proj`) are pieces
(expert, slice) of its stacked experts linears. Each parameter's `weight_loader` (if any) receives the full tensor and
keeps this rank's shard; the copy into the parameter converts the dtype and moves it to the device.
"""

from __future__ import annotations

import glob
import logging
import os
import re

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


# One expert's linear in a per-expert checkpoint (Mixtral's w1/w3/w2, OLMoE's and Qwen3-MoE's gate/up/down_proj) ->
# (stacked experts linear, slice).
_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
EXPERT_SLICES = {
    "w1": ("gate_up_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "up_proj": ("gate_up_proj", 1),
    "w2": ("down_proj", 0),
    "down_proj": ("down_proj", 0),
}
# Stacked (experts, out, in) tensors, as transformers 5 names the parameters: the whole of our experts linear.
_STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def map_hf_name(hf_name: str) -> tuple[str, int | tuple[int, int] | None]:
    """HF parameter name -> (our parameter name, slice of a fused layer or (expert, slice) of a stacked experts
    linear, or None for all of it)."""
    hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name of the MoE block
    expert = _EXPERT.search(hf_name)
    if expert is not None:
        stacked, slice_id = EXPERT_SLICES[expert[2]]
        return f"{hf_name[: expert.start()]}.experts.{stacked}.weight", (int(expert[1]), slice_id)
    if _STACKED_EXPERTS.search(hf_name):
        return f"{hf_name}.weight", None
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


def renamed(hf_name: str, prefixes: tuple[tuple[str, str | None], ...]) -> str | None:
    """The checkpoint name under a model's `checkpoint_prefixes` (the first that matches), None = not loaded."""
    for prefix, ours in prefixes:
        if hf_name.startswith(prefix):
            return None if ours is None else ours + hf_name[len(prefix) :]
    return hf_name


def load_weights(model: nn.Module, model_dir: str, *, show_progress: bool = True) -> None:
    """show_progress: report tensors loaded (a bar on a terminal, else log lines); one rank of several says it.
    A model class may list `checkpoint_prefixes` ((checkpoint prefix, ours or None to skip), ...)."""
    prefixes = getattr(model, "checkpoint_prefixes", ())
    params = dict(model.named_parameters())  # a tied weight appears once, under its first name
    aliases = set(dict(model.named_parameters(remove_duplicate=False))) - set(params)
    shards: dict[str, list] = {}  # a parameter loaded in pieces -> the pieces' shard ids
    for name, module in model.named_modules():
        if hasattr(module, "checkpoint_shards"):  # stacked experts
            shards[f"{name}.weight"] = module.checkpoint_shards()
        elif getattr(module, "num_slices", 1) > 1:
            # each of a fused layer's own tensors (weight, bias, a quantized format's) per slice
            for suffix, _ in module.named_parameters(recurse=False):
                shards[f"{name}.{suffix}"] = list(range(module.num_slices))
    expected = {(name, shard) for name in params for shard in shards.get(name, [None])}
    loaded: set[tuple[str, int | tuple[int, int] | None]] = set()
    ignored: list[str] = []  # e.g. the layers --hf-overrides '{"num_hidden_layers": N}' leaves out
    files = checkpoint_files(model_dir)
    total = sum(_num_tensors(path) for path in files)
    with Progress(logger, f"loading {model_dir}", total, "tensors", enabled=show_progress) as progress:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for hf_name in f.keys():
                    progress.update()
                    local_name = renamed(hf_name, prefixes)
                    if local_name is None or hf_name.endswith(IGNORED_SUFFIXES):
                        continue
                    name, slice_id = map_hf_name(local_name)
                    if name in aliases:
                        continue  # a tied weight: loaded under the name it is shared with
                    if name not in params:
                        ignored.append(hf_name)
                        continue
                    _load_one(params[name], f.get_tensor(hf_name), slice_id, hf_name)
                    if slice_id is None and name in shards:  # a stacked or fused (Phi-3) tensor holds every piece
                        loaded.update((name, shard) for shard in shards[name])
                    else:
                        loaded.add((name, slice_id))
    if ignored:
        logger.warning("ignoring %d checkpoint tensors with no parameter here, e.g. %s", len(ignored),
                       ", ".join(ignored[:3]))  # fmt: skip
    missing = sorted(f"{name}[{slice_id}]" if slice_id is not None else name for name, slice_id in expected - loaded)
    if missing:
        raise CheckpointError(f"checkpoint {model_dir!r} lacks {len(missing)} tensors, e.g. {', '.join(missing[:5])}")


def _num_tensors(path: str) -> int:
    with safe_open(path, framework="pt", device="cpu") as f:
        return len(f.keys())


@torch.no_grad()
def _load_one(
    param: nn.Parameter, tensor: torch.Tensor, slice_id: int | tuple[int, int] | None, hf_name: str
) -> None:
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
