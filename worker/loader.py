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
import itertools
import logging
import os
import re
from typing import Any

import torch
from loraplex.kernels.progress import Progress
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
# Checkpoint entries with no parameter here that carry nothing the forward pass reads: old checkpoints saved the
# rotary table, which the model recomputes from config.json. Any other tensor without a parameter stops the load
# (its values would be dropped), except the cases `_skipped` names.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    pass


# One expert's linear in a per-expert checkpoint (Mixtral's w1/w3/w2, OLMoE's and Qwen3-MoE's gate/up/down_proj) ->
# (stacked experts linear, slice); its tensor is `weight`, or a quantized format's (`qweight`, `weight_scale_inv`...).
_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.(?!bias$)(\w+)$")
EXPERT_SLICES = {
    "w1": ("gate_up_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "up_proj": ("gate_up_proj", 1),
    "w2": ("down_proj", 0),
    "down_proj": ("down_proj", 0),
}
# Stacked (experts, out, in) tensors, as transformers 5 names the parameters: the whole of our experts linear
# (gpt-oss's: (experts, in, out), and a stacked bias beside each, `gate_up_proj_bias`).
_STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
_STACKED_EXPERT_BIAS = re.compile(r"\.experts\.(gate_up_proj|down_proj)_bias$")
# MXFP4 experts (worker/quant/mxfp4.py): codes and scales of each stacked linear
_STACKED_EXPERT_MXFP4 = re.compile(r"\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$")


def map_hf_name(hf_name: str) -> tuple[str, int | tuple[int, int] | None]:
    """HF parameter name -> (our parameter name, slice of a fused layer or (expert, slice) of a stacked experts
    linear, or None for all of it)."""
    hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name of the MoE block
    hf_name = hf_name.replace(".mlp.router.", ".mlp.gate.")  # gpt-oss's name of the router
    expert = _EXPERT.search(hf_name)
    if expert is not None:
        stacked, slice_id = EXPERT_SLICES[expert[2]]
        return f"{hf_name[: expert.start()]}.experts.{stacked}.{expert[3]}", (int(expert[1]), slice_id)
    if _STACKED_EXPERTS.search(hf_name):
        return f"{hf_name}.weight", None
    if (bias := _STACKED_EXPERT_BIAS.search(hf_name)) is not None:
        return f"{hf_name[: bias.start()]}.experts.{bias[1]}.bias", None
    if (packed := _STACKED_EXPERT_MXFP4.search(hf_name)) is not None:
        return f"{hf_name[: packed.start()]}.experts.{packed[1]}.{packed[2]}", None
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


def module_renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """The name with the first of a model's `checkpoint_renames` (checkpoint part, ours) it holds replaced once."""
    for theirs, ours in renames:
        if theirs in name:
            return name.replace(theirs, ours, 1)
    return name


def checkpoint_module_names(model: nn.Module, module_name: str) -> list[list[str]]:
    """The checkpoint (HF) names of the modules whose tensors load into our module `module_name`: one list per piece
    (a fused layer's slice, one expert's slice), each holding every spelling a checkpoint may use for it (the
    inverse of map_hf_name and the model's `checkpoint_prefixes`)."""
    module = model.get_submodule(module_name)
    base, _, last = module_name.rpartition(".")
    if hasattr(module, "checkpoint_shards"):  # stacked experts: base is "...mlp.experts"
        block = base.removesuffix(".experts")
        blocks = [block, block.removesuffix(".mlp") + ".block_sparse_moe"] if block.endswith(".mlp") else [block]
        pieces = [[f"{b}.experts.{expert}.{hf}" for b in blocks
                   for hf, piece in EXPERT_SLICES.items() if piece == (last, slice_id)]
                  for expert, slice_id in module.checkpoint_shards()]
    else:  # a fused layer's slices, or the layer stored fused (Phi-3: qkv_proj, gate_up_proj) or unfused
        pieces = [[f"{base}.{hf}", module_name] for hf, fused, _ in FUSED_SLICES if fused == last] or [[module_name]]
    prefixes = getattr(model, "checkpoint_prefixes", ())
    renames = getattr(model, "checkpoint_renames", ())

    def spellings(name: str) -> list[str]:  # ours, and under each checkpoint prefix renamed to ours
        # the checkpoint's module path (the first of checkpoint_renames whose part of ours the name holds)
        name = next((name.replace(ours, theirs, 1) for theirs, ours in renames if ours in name), name)
        return [name, *(prefix + name[len(ours) :] for prefix, ours in prefixes
                        if ours is not None and name.startswith(ours))]

    return [[spelled for name in piece for spelled in spellings(name)] for piece in pieces]


def load_weights(model: nn.Module, model_dir: str, *, show_progress: bool = True) -> None:
    """show_progress: report tensors loaded (a bar on a terminal, else log lines); one rank of several says it.
    A model class may list `checkpoint_prefixes` ((checkpoint prefix, ours or None to skip), ...) and
    `checkpoint_renames` ((checkpoint module path part, ours), ...: Llama 4's `feed_forward`). Every checkpoint
    tensor is read into a parameter, or skipped for a reason `_skipped` gives; any other stops the load, before any
    weight is read, naming it."""
    prefixes = getattr(model, "checkpoint_prefixes", ())
    module_renames = getattr(model, "checkpoint_renames", ())
    params = dict(model.named_parameters())  # a tied weight appears once, under its first name
    aliases = set(dict(model.named_parameters(remove_duplicate=False))) - set(params)
    shards: dict[str, list] = {}  # a parameter loaded in pieces -> the pieces' shard ids
    for name, module in model.named_modules():
        if hasattr(module, "checkpoint_shards"):  # stacked experts: each tensor (a quantized format's too) per piece
            for suffix, _ in module.named_parameters(recurse=False):
                if suffix != "bias":
                    shards[f"{name}.{suffix}"] = module.checkpoint_shards()
        elif getattr(module, "num_slices", 1) > 1:
            # each of a fused layer's own tensors (weight, bias, a quantized format's) per slice
            for suffix, _ in module.named_parameters(recurse=False):
                shards[f"{name}.{suffix}"] = list(range(module.num_slices))
    expected = {(name, shard) for name in params for shard in shards.get(name, [None])}
    num_layers = 1 + max((int(m[1]) for name in params if (m := _LAYER.search(name))), default=-1)
    plan: list[tuple[str, str, str, int | tuple[int, int] | None]] = []  # (file, checkpoint name, ours, slice)
    unread: list[str] = []
    num_cut = 0  # tensors of the layers --hf-overrides '{"num_hidden_layers": N}' leaves out
    files = checkpoint_files(model_dir)
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                local_name = renamed(hf_name, prefixes)
                if local_name is None or hf_name.endswith(IGNORED_SUFFIXES):
                    continue
                local_name = module_renamed(local_name, module_renames)
                name, slice_id = map_hf_name(local_name)
                if name not in params and local_name in params:  # a model's own unfused q_proj (latent attention)
                    name, slice_id = local_name, None
                if name in params:
                    plan.append((path, hf_name, name, slice_id))
                elif name in aliases:
                    continue  # a tied weight: loaded under the name it is shared with
                elif (reason := _skipped(name, num_layers, f, hf_name)) is None:
                    unread.append(hf_name)
                elif reason == "cut":
                    num_cut += 1
    if unread:
        raise CheckpointError(f"checkpoint {model_dir!r} has {len(unread)} tensors no parameter here reads (their "
                              f"values would be dropped), e.g. {', '.join(unread[:5])}")
    if num_cut:
        logger.info("skipping %d checkpoint tensors of the layers from %d on (the model is built with %d)", num_cut,
                    num_layers, num_layers)
    loaded: set[tuple[str, int | tuple[int, int] | None]] = set()
    with Progress(logger, f"loading {model_dir}", len(plan), "tensors", enabled=show_progress) as progress:
        for path, entries in itertools.groupby(plan, key=lambda entry: entry[0]):
            with safe_open(path, framework="pt", device="cpu") as f:
                for _, hf_name, name, slice_id in entries:
                    progress.update()
                    _load_one(params[name], f.get_tensor(hf_name), slice_id, hf_name)
                    if slice_id is None and name in shards:  # a stacked or fused (Phi-3) tensor holds every piece
                        loaded.update((name, shard) for shard in shards[name])
                    else:
                        loaded.add((name, slice_id))
    missing = sorted(f"{name}[{slice_id}]" if slice_id is not None else name for name, slice_id in expected - loaded)
    if missing:
        raise CheckpointError(f"checkpoint {model_dir!r} lacks {len(missing)} tensors, e.g. {', '.join(missing[:5])}")


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_KV_CACHE_SCALES = (".k_scale", ".v_scale", ".kv_scale")


def _skipped(name: str, num_layers: int, f: Any, hf_name: str) -> str | None:
    """Why a checkpoint tensor with no parameter here carries nothing the model computes with, or None (an error)."""
    layer = _LAYER.search(name)
    if layer is not None and int(layer[1]) >= num_layers:
        return "cut"  # a layer the model is built without (--hf-overrides num_hidden_layers; an MTP layer)
    if name.endswith(_KV_CACHE_SCALES) and ".self_attn." in name:
        return "kv scale"  # an FP8 KV cache's static scales (kv_cache_scheme): worker/kv_scales.py reads them for fp8
    if name.endswith(".bias") and not f.get_tensor(hf_name).any():
        return "zero bias"  # quantizers (AutoGPTQ) may save zeros for a linear without a bias: adding them is a no-op
    return None


@torch.no_grad()
def _load_one(
    param: nn.Parameter, tensor: torch.Tensor, slice_id: int | tuple[int, int] | None, hf_name: str
) -> None:
    loader = getattr(param, "weight_loader", None)
    if param.numel() and param.is_floating_point() and (not tensor.is_floating_point() or tensor.element_size() == 1):
        # a quantized checkpoint's stored values (FP8, packed integers) would be read as if they were the weights
        raise CheckpointError(f"{hf_name}: stored as {str(tensor.dtype).removeprefix('torch.')}, quantized values "
                              f"that this {str(param.dtype).removeprefix('torch.')} parameter cannot read")
    try:
        if loader is not None:
            loader(param, tensor, slice_id)
        elif tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        else:
            param.data.copy_(tensor)
    except ValueError as e:
        raise CheckpointError(f"{hf_name}: {e}") from e
