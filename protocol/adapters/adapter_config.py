"""adapter_config.json, parsed once by one rule set: the frontend (sizing the pool from the start-up adapters) and
every worker (loading one) read a PEFT adapter's config here. Plain Python, no torch.

What is refused is what would change the math beyond y += scale · x·Aᵀ·Bᵀ (with DoRA, y's rows then rescaled) on
our seven linears (in an MoE model, the experts' gate/up/down are three of them) and the embedding's and LM head's
(lora_targets.MODEL_TARGETS), so an adapter is never served wrong; what depends on the server (the pool's rank and
modules, the model's layer count) is checked by the worker that holds them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from loraplex.protocol.adapters.lora_targets import (
    ALL_TARGETS,
    ENCODER_MODULE_ALIASES,
    EXPERT_MODULE_ALIASES,
    EXPERT_PARAMETERS,
    FUSED_TARGETS,
)

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class AdapterLoadError(ValueError):
    """An adapter refused; `kind` is a kind of protocol.errors.STATUS_BY_KIND, as every error's (`ServerError.kind`).
    The message names the cause and is passed on to the user as it is."""

    def __init__(self, message: str, kind: str = "invalid"):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class AdapterConfig:
    r: int
    lora_alpha: float
    # our module names, each once, in ALL_TARGETS order; a fused module (qkv_proj, gate_up_proj) as its slices
    target_modules: tuple[str, ...]
    use_rslora: bool
    layers: tuple[int, ...] | None  # layers_to_transform, sorted, each once; None: every layer
    base_model_name_or_path: str | None
    # PEFT's per-module rank and alpha: (pattern, value) pairs, in the file's order (the first match wins, as in PEFT)
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    # DoRA: each targeted module's output rows scaled by magnitude / ||W + scale·B·A|| (worker/lora/dora.py)
    use_dora: bool = False
    # PEFT's modules_to_save: full copies of embed_tokens / lm_head / a classifier's head (worker/lora/copies.py)
    modules_to_save: tuple[str, ...] = ()
    # PEFT's trainable_token_indices: the embedding rows the adapter replaces, in the order its tensor holds them
    trainable_tokens: tuple[int, ...] = ()
    # the target_modules names of a vision tower's and its merger's linears (TOWER_TARGETS), as listed; served only
    # with --enable-tower-connector-lora (worker/lora/tower.py)
    tower_modules: tuple[str, ...] = ()

    @property
    def scale(self) -> float:
        """lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
        return self.module_scale(self.r, self.lora_alpha)

    def module_scale(self, r: int, lora_alpha: float) -> float:
        return lora_alpha / (math.sqrt(r) if self.use_rslora else r)

    @property
    def max_rank(self) -> int:
        """The largest rank of any module (the pool must hold it)."""
        return max([self.r, *(r for _, r in self.rank_pattern)])

    def module_rank_alpha(self, module_name: str) -> tuple[int, float]:
        """(r, lora_alpha) of one module by its full name (e.g. model.layers.0.self_attn.q_proj, or a stacked
        experts parameter model.layers.0.mlp.experts.gate_up_proj), the patterns matched as PEFT matches them."""
        return _pattern_value(self.rank_pattern, module_name, self.r), _pattern_value(
            self.alpha_pattern, module_name, self.lora_alpha
        )


def _pattern_value(patterns: tuple[tuple[str, Any], ...], module_name: str, default: Any) -> Any:
    for pattern, value in patterns:  # peft.utils.other.get_pattern_key
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            return value
    return default


def parse_adapter_config(raw: Any) -> AdapterConfig:
    """adapter_config.json's content (a decoded JSON value) as an AdapterConfig; AdapterLoadError says what is wrong."""
    if not isinstance(raw, dict):
        raise AdapterLoadError(f"the adapter config must be a JSON object ({CONFIG_FILE}), got {raw!r}")
    for field in ("r", "lora_alpha"):
        if field not in raw:
            raise AdapterLoadError(f"{CONFIG_FILE} lacks the field {field!r}")
    if not raw.get("target_modules") and not raw.get("target_parameters"):
        raise AdapterLoadError(f"{CONFIG_FILE} lacks the field 'target_modules'")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterLoadError(f"peft_type {peft_type!r} is not supported (only LORA)")
    lora_rank, lora_alpha = raw["r"], raw["lora_alpha"]
    if not isinstance(lora_rank, int) or isinstance(lora_rank, bool) or lora_rank < 1:
        raise AdapterLoadError(f"'r' must be a positive integer, got {lora_rank!r}")
    if not isinstance(lora_alpha, (int, float)) or isinstance(lora_alpha, bool) or not math.isfinite(lora_alpha):
        raise AdapterLoadError(f"'lora_alpha' must be a number, got {lora_alpha!r}")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterLoadError(f"'use_rslora' must be true or false, got {use_rslora!r}")
    # Features that change the math beyond y += scale · x·Aᵀ·Bᵀ: refused rather than served wrong.
    use_dora = raw.get("use_dora", False)
    if not isinstance(use_dora, bool):
        raise AdapterLoadError(f"'use_dora' must be true or false, got {use_dora!r}")
    if use_dora and raw.get("target_parameters"):
        raise AdapterLoadError("DoRA (use_dora: true) on target_parameters (MoE experts) is not supported")
    if raw.get("bias", "none") != "none":
        raise AdapterLoadError(f"bias {raw['bias']!r} is not supported (must be 'none')")
    if raw.get("fan_in_fan_out"):
        raise AdapterLoadError("fan_in_fan_out adapters are not supported")
    base_model = raw.get("base_model_name_or_path")
    return AdapterConfig(
        r=lora_rank,
        lora_alpha=lora_alpha,
        target_modules=_ordered(
            _parse_targets(raw.get("target_modules")) + _parse_target_parameters(raw.get("target_parameters"))
        ),
        use_rslora=use_rslora,
        layers=_parse_layers(raw.get("layers_to_transform")),
        base_model_name_or_path=base_model if isinstance(base_model, str) else None,
        rank_pattern=_parse_pattern(raw.get("rank_pattern"), "rank_pattern", is_rank=True),
        alpha_pattern=_parse_pattern(raw.get("alpha_pattern"), "alpha_pattern", is_rank=False),
        use_dora=use_dora,
        modules_to_save=_parse_modules_to_save(raw.get("modules_to_save")),
        trainable_tokens=_parse_trainable_tokens(raw.get("trainable_token_indices")),
        tower_modules=tuple(t for t in raw.get("target_modules") or () if isinstance(t, str) and t in TOWER_TARGETS),
    )


# A pooling classifier's head (worker/pooling.py), served by the pooling runner only: a decoder's `score`, BERT's
# `classifier` and the `pooler.dense` before it. PEFT's SEQ_CLS task lists "classifier" and "score" both, whichever
# the model has, so a head name the adapter holds no copy of is not an error where it holds another.
HEAD_MODULES = ("score", "classifier", "pooler.dense")
COPYABLE_MODULES = ("embed_tokens", "lm_head", *HEAD_MODULES)
_MODULE_ALIASES = {"pooler": "pooler.dense"}  # BERT's pooler holds one linear (then tanh)


def _parse_modules_to_save(modules: Any) -> tuple[str, ...]:
    """Only full copies of the embedding, the LM head and a classifier's head are served; any other module is
    refused."""
    if not modules:
        return ()
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise AdapterLoadError(f"modules_to_save must be a list of module names, got {modules!r}")
    modules = [_MODULE_ALIASES.get(m, m) for m in modules]
    other = [m for m in modules if m not in COPYABLE_MODULES]
    if other:
        raise AdapterLoadError(f"modules_to_save {other!r} is not supported (only {', '.join(COPYABLE_MODULES)})")
    return tuple(m for m in COPYABLE_MODULES if m in modules)


def _parse_trainable_tokens(indices: Any) -> tuple[int, ...]:
    """A list of token ids, or {"embed_tokens": [...]} (PEFT's two forms); only the input embedding is patched."""
    if not indices:
        return ()
    if isinstance(indices, dict):
        other = [name for name in indices if name != "embed_tokens"]
        if other:
            raise AdapterLoadError(f"trainable_token_indices on {other!r} is not supported (only embed_tokens)")
        indices = indices["embed_tokens"]
    if not isinstance(indices, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in indices):  # fmt: skip
        raise AdapterLoadError(f"trainable_token_indices must be a list of token ids, got {indices!r}")
    if len(set(indices)) != len(indices):
        raise AdapterLoadError(f"trainable_token_indices lists a token twice: {indices!r}")
    return tuple(indices)


def _ordered(modules: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(m for m in ALL_TARGETS if m in modules)


def _parse_target_parameters(params: Any) -> tuple[str, ...]:
    """PEFT's target_parameters: only the stacked expert tensors of an MoE model (their experts' MLP modules)."""
    if not params:
        return ()
    if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
        raise AdapterLoadError(f"target_parameters must be a list of parameter names, got {params!r}")
    modules: list[str] = []
    for param in params:
        stacked = next((s for s in EXPERT_PARAMETERS if param == s or param.endswith(f".{s}")), None)
        if stacked is None:
            raise AdapterLoadError(
                f"target_parameters {param!r} is not supported; only {', '.join(EXPERT_PARAMETERS)} (MoE experts)"
            )
        modules += EXPERT_PARAMETERS[stacked]
    return tuple(modules)


def _parse_pattern(pattern: Any, field: str, *, is_rank: bool) -> tuple[tuple[str, Any], ...]:
    if not pattern:
        return ()
    if not isinstance(pattern, dict):
        raise AdapterLoadError(f"{field!r} must be an object of module pattern -> value, got {pattern!r}")
    pairs = []
    for key, value in pattern.items():
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not is_number or (is_rank and (not isinstance(value, int) or value < 1)):
            kind = "a positive integer" if is_rank else "a number"
            raise AdapterLoadError(f"{field} {key!r}: the value must be {kind}, got {value!r}")
        try:
            re.compile(key)
        except re.error as e:
            raise AdapterLoadError(f"{field} {key!r} is not a valid pattern: {e}") from e
        pairs.append((key, value))
    return tuple(pairs)


# Qwen2.5-VL's vision tower (attn.qkv, attn.proj) and patch merger (mlp.0, mlp.2) linears, as PEFT's target_modules
# name them; its tower MLP shares gate_proj/up_proj/down_proj with the language model (told apart by the tensors).
# Llama 4's vision MLPs and pixel-shuffle adapter (fc1, fc2) and projector (linear_1); its vision attention shares
# q/k/v/o_proj with the language model. Qwen3-VL's tower MLP and (deepstack) mergers: linear_fc1, linear_fc2.
# Gemma 3's SigLIP MLP is fc1/fc2 too (its q/k/v/out_proj: worker/lora/tower.py). Gemma 4's tower: the `linear`
# inside each of its clippable q/k/v/o and MLP projections; its embedder's projection.
TOWER_TARGETS = ("qkv", "attn.qkv", "proj", "attn.proj", "mlp.0", "mlp.2", "merger.mlp.0", "merger.mlp.2",
                 "fc1", "fc2", "mlp.fc1", "mlp.fc2", "linear_1", "multi_modal_projector.linear_1",
                 "linear_fc1", "linear_fc2", "mlp.linear_fc1", "mlp.linear_fc2", "merger.linear_fc1",
                 "merger.linear_fc2", "linear", "embedding_projection")


def _parse_targets(targets: Any) -> tuple[str, ...]:
    """Our module names; Mixtral's expert names (w1/w3/w2) are its experts' gate/up/down, BERT's (query, ...,
    output.dense: ENCODER_MODULE_ALIASES) the modules serving them, a fused module (FUSED_TARGETS) its slices.
    None or [] (PEFT saves [] for an adapter on target_parameters alone): none."""
    if targets is None or targets == []:
        return ()
    if isinstance(targets, str):
        raise AdapterLoadError(
            f"target_modules {targets!r} is a pattern; only a list of module names is supported "
            f"({', '.join(ALL_TARGETS)})"
        )
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterLoadError(f"target_modules must be a non-empty list of module names, got {targets!r}")
    targets = [EXPERT_MODULE_ALIASES.get(target, target) for target in targets if target not in TOWER_TARGETS]
    modules = []
    for target in targets:
        if target in FUSED_TARGETS:
            for part in FUSED_TARGETS[target]:
                if part in targets:
                    raise AdapterLoadError(f"target_modules lists both {target!r} and its slice {part!r}")
            modules.extend(FUSED_TARGETS[target])
        elif target in ALL_TARGETS:
            modules.append(target)
        elif target in ENCODER_MODULE_ALIASES:
            modules.extend(ENCODER_MODULE_ALIASES[target])
        else:
            known = ", ".join((*ALL_TARGETS, *FUSED_TARGETS, *ENCODER_MODULE_ALIASES))
            raise AdapterLoadError(f"unknown target module {target!r}; LoRA supports {known}")
    return _ordered(tuple(modules))


def _parse_layers(layers: Any) -> tuple[int, ...] | None:
    if layers is None:
        return None
    layers = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise AdapterLoadError(f"layers_to_transform must be an integer or a list of integers, got {layers!r}")
    return tuple(sorted(set(layers)))
