"""An adapter's expert weights, in either of PEFT's forms, as one stacked (A, B) pair per (layer, MLP module):
A (experts, r, in), B (experts, out, r), whole (unsharded), each module's scale folded into B relative to the
adapter's (the pool holds one scale per slot).

- Per-expert modules (adapters trained on transformers 4's modules; Mixtral's `experts.N.w1/w3/w2`, OLMoE's and
  Qwen3-MoE's `experts.N.gate_proj/up_proj/down_proj`): one 2-D A and B per expert and module, stacked here.
- PEFT's `target_parameters` over transformers 5's stacked tensors: one LoRA per parameter, saved under the experts
  module (`mlp.experts.lora_A.weight`; a second parameter on the same module nests as `experts.base_layer.lora_A`).
  A is (experts * r, in), expert e's rows e*r ... e*r + r; B is (out, r * experts), expert e's columns e, e + E, ...
  (peft's ParamWrapper). gate_up_proj's one A serves both gate and up, its B's rows are [gate | up]. The keys do not
  say which parameter is which: their shapes do (gate_up: in = hidden, out = 2 * intermediate; down: in =
  intermediate, out = hidden; both at once would need hidden = intermediate = 2 * intermediate). Llama 4 stores its
  stacked experts (experts, in, out) without transformers' mark of a transposed layout, so PEFT reads them as
  (experts, out, in): its A (experts * r, out) and B (in, r * experts) then play each other's part (transposed).
  gpt-oss's (experts, in, out) carry that mark (no swap), and its gate_up alternates gate and up rows (its B's too),
  reordered here into [gate | up].
"""

from __future__ import annotations

import re

import torch
from loraplex.protocol.adapters.adapter_config import AdapterConfig, AdapterLoadError
from loraplex.protocol.adapters.lora_targets import EXPERT_MODULE_ALIASES, EXPERT_PARAMETERS
from loraplex.worker.lora.targets import full_shapes, is_expert_module
from loraplex.worker.model.config import ModelConfig

_PER_EXPERT = re.compile(r"(?:^|\.)(layers\.(\d+)\.(?:\w+\.)*?experts\.(\d+)\.(\w+))\.lora_([AB])(?:\.\w+)?\.weight$")
_STACKED = re.compile(r"(?:^|\.)(layers\.(\d+)\.(?:\w+\.)*?experts)((?:\.base_layer)*)\.lora_([AB])(?:\.\w+)?\.weight$")

ExpertPairs = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def is_expert_key(key: str) -> bool:
    return _PER_EXPERT.search(key) is not None or _STACKED.search(key) is not None


def match_expert_tensors(
    tensors: dict[str, torch.Tensor], config: AdapterConfig, model_config: ModelConfig
) -> ExpertPairs:
    """(layer, module) -> (A, B) stacked over experts, for every expert key of `tensors`; AdapterLoadError names
    what does not fit the model or the config."""
    moe = model_config.moe
    if moe is None:
        raise AdapterLoadError(f"tensor {next(iter(tensors))!r} is for MoE experts; the base model has none")
    per_expert: dict[tuple[int, str, str], dict[int, torch.Tensor]] = {}
    stacked: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    names: dict[tuple[int, str], str] = {}  # (layer, module) -> the module's full name, for rank/alpha patterns
    for key, tensor in tensors.items():
        layer = _check_layer(key, model_config)
        if (match := _PER_EXPERT.search(key)) is not None:
            module = EXPERT_MODULE_ALIASES.get(match[4], match[4])
            expert = int(match[3])
            if module not in EXPERT_PARAMETERS["experts.gate_up_proj"] + EXPERT_PARAMETERS["experts.down_proj"]:
                raise AdapterLoadError(f"tensor {key!r}: unknown expert module {match[4]!r}")
            if not expert < moe.num_experts:
                raise AdapterLoadError(f"tensor {key!r}: expert {expert} of a model with {moe.num_experts} experts")
            if module not in config.target_modules:
                raise AdapterLoadError(f"tensor {key!r} is for {module!r}, which the adapter config does not target")
            per_expert.setdefault((layer, module, match[5]), {})[expert] = tensor
            names[(layer, module)] = "model." + match[1]  # rank/alpha patterns match module names, one expert's
        else:
            match = _STACKED.search(key)
            stacked.setdefault((layer, "model." + match[1] + match[3]), {})[match[4]] = (key, tensor)
    pairs: ExpertPairs = {}
    for (layer, module, which), by_expert in per_expert.items():
        if which == "B":
            continue
        pairs[(layer, module)] = _stack_experts(layer, module, by_expert, per_expert.get((layer, module, "B"), {}),
                                                names[(layer, module)], config, model_config)  # fmt: skip
    for (layer, name), both in stacked.items():
        for module, pair in _split_stacked(layer, name, both, config, model_config).items():
            if (layer, module) in pairs:
                raise AdapterLoadError(f"layer {layer}'s experts' {module} appears twice in the adapter")
            pairs[(layer, module)] = pair
    return pairs


def _check_layer(key: str, model_config: ModelConfig) -> int:
    layer = int((_PER_EXPERT.search(key) or _STACKED.search(key))[2])
    if not layer < model_config.num_layers:
        raise AdapterLoadError(
            f"tensor {key!r}: layer {layer} is out of range (the base model has {model_config.num_layers} layers)"
        )
    if not is_expert_module(model_config, layer, "gate_proj"):
        raise AdapterLoadError(f"tensor {key!r} is for experts, but layer {layer} of the base model is dense")
    return layer


def _stack_experts(
    layer: int,
    module: str,
    a_by_expert: dict[int, torch.Tensor],
    b_by_expert: dict[int, torch.Tensor],
    name: str,
    config: AdapterConfig,
    model_config: ModelConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_experts = model_config.moe.num_experts
    for which, by_expert in (("A", a_by_expert), ("B", b_by_expert)):
        missing = [e for e in range(num_experts) if e not in by_expert]
        if missing:
            raise AdapterLoadError(f"missing lora_{which} weight for layers.{layer} experts {missing[:4]} {module}")
    r, alpha = config.module_rank_alpha(name)
    in_features, out_features = full_shapes(model_config)[f"experts.{module}"]
    for expert in range(num_experts):
        for which, tensor, expected in (("A", a_by_expert[expert], (r, in_features)),
                                        ("B", b_by_expert[expert], (out_features, r))):  # fmt: skip
            if tuple(tensor.shape) != expected:
                raise AdapterLoadError(
                    f"shape mismatch with the base model: layers.{layer} expert {expert} {module} lora_{which} has "
                    f"shape {tuple(tensor.shape)}, expected {expected} (r={r})"
                )
    lora_a = torch.stack([a_by_expert[e] for e in range(num_experts)])  # (experts, r, in)
    lora_b = torch.stack([b_by_expert[e] for e in range(num_experts)])  # (experts, out, r)
    return lora_a, _scaled(lora_b, config, r, alpha)


def _split_stacked(
    layer: int, name: str, both: dict[str, tuple[str, torch.Tensor]], config: AdapterConfig, model_config: ModelConfig
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One target_parameters LoRA (its A and B under `name`) as per-module stacked pairs."""
    for which in "AB":
        if which not in both:
            raise AdapterLoadError(f"missing lora_{which} weight for {name}")
    (key_a, lora_a), (key_b, lora_b) = both["A"], both["B"]
    num_experts = model_config.moe.num_experts
    shapes = full_shapes(model_config)
    hidden, inter = shapes["experts.gate_proj"]
    if lora_a.dim() != 2 or lora_b.dim() != 2:
        raise AdapterLoadError(f"tensors {key_a!r} and {key_b!r} must be 2-D")
    # (in, out) of the linear; where PEFT read (experts, in, out) tensors as (experts, out, in) (Llama 4), its A maps
    # the linear's output side and its B the input side
    swapped = model_config.moe.stacked_in_out
    in_out = (lora_b.shape[0], lora_a.shape[1]) if swapped else (lora_a.shape[1], lora_b.shape[0])
    param = {(hidden, 2 * inter): "experts.gate_up_proj", (inter, hidden): "experts.down_proj"}.get(in_out)
    if param is None:
        raise AdapterLoadError(
            f"tensors {key_a!r} {tuple(lora_a.shape)} and {key_b!r} {tuple(lora_b.shape)} fit neither stacked expert "
            f"parameter (gate_up_proj: {hidden} -> {2 * inter}, down_proj: {inter} -> {hidden})"
        )
    modules = EXPERT_PARAMETERS[param]
    if not set(modules) <= set(config.target_modules):
        raise AdapterLoadError(f"tensor {key_a!r} is for {param}, which the adapter config does not target")
    param_name = re.sub(r"(\.base_layer)*$", "", name).removesuffix(".experts") + f".{param}"
    r, alpha = config.module_rank_alpha(param_name)
    if tuple(lora_a.shape) != (r * num_experts, lora_a.shape[1]) or tuple(lora_b.shape) != (
        lora_b.shape[0], r * num_experts
    ):
        raise AdapterLoadError(
            f"shape mismatch with the base model: {key_a!r} {tuple(lora_a.shape)} and {key_b!r} "
            f"{tuple(lora_b.shape)} are not r={r} for each of {num_experts} experts"
        )
    if swapped:  # y = x·(W + B_e A_e) with W (in, out): our A_e is their B_eᵀ, our B_e their A_eᵀ
        stacked_a = lora_b.view(-1, r, num_experts).permute(2, 1, 0)  # (experts, r, in)
        stacked_b = _scaled(lora_a.view(num_experts, r, -1).transpose(1, 2), config, r, alpha)  # (experts, out, r)
    else:
        stacked_a = lora_a.view(num_experts, r, -1)  # (experts, r, in)
        stacked_b = _scaled(lora_b.view(-1, r, num_experts).permute(2, 0, 1), config, r, alpha)  # (experts, out, r)
    if len(modules) > 1 and model_config.moe.gate_up_interleaved:  # gpt-oss: rows g0 u0 g1 u1 ... -> [gate | up]
        stacked_b = stacked_b.unflatten(1, (-1, len(modules))).transpose(1, 2).flatten(1, 2)
    out_sizes = [shapes[f"experts.{m}"][1] for m in modules]
    return {module: (stacked_a, b) for module, b in zip(modules, stacked_b.split(out_sizes, dim=1), strict=True)}


def _scaled(lora_b: torch.Tensor, config: AdapterConfig, r: int, alpha: float) -> torch.Tensor:
    """B with this module's scale over the adapter's folded in (the pool has one scale per slot)."""
    ratio = config.module_scale(r, alpha) / config.scale
    return lora_b if ratio == 1.0 else lora_b * ratio
