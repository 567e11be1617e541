"""adapter_config.json, parsed once by one rule set: the frontend (sizing the pool from the start-up adapters) and
every worker (loading one) read a PEFT adapter's config here. Plain Python, no torch.

What is refused is what would change the math beyond y += scale · x·Aᵀ·Bᵀ on our seven linears (and the embedding's
and LM head's, protocol/lora_targets.MODEL_TARGETS), so an adapter is
never served wrong; what depends on the server (the pool's rank and modules, the model's layer count) is checked by
the worker that holds them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from loraplex.protocol.lora_targets import ALL_TARGETS, FUSED_TARGETS

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class AdapterLoadError(ValueError):
    """An adapter refused; error_kind is a kind of protocol.errors.STATUS_BY_KIND. The message names the cause and
    is passed on to the user as it is."""

    def __init__(self, message: str, error_kind: str = "invalid"):
        super().__init__(message)
        self.error_kind = error_kind


@dataclass(frozen=True)
class AdapterConfig:
    r: int
    lora_alpha: float
    # our module names, each once, in ALL_TARGETS order; a fused module (qkv_proj, gate_up_proj) as its slices
    target_modules: tuple[str, ...]
    use_rslora: bool
    layers: tuple[int, ...] | None  # layers_to_transform, sorted, each once; None: every layer
    base_model_name_or_path: str | None

    @property
    def scale(self) -> float:
        """lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def parse_adapter_config(raw: Any) -> AdapterConfig:
    """adapter_config.json's content (a decoded JSON value) as an AdapterConfig; AdapterLoadError says what is wrong."""
    if not isinstance(raw, dict):
        raise AdapterLoadError(f"the adapter config must be a JSON object ({CONFIG_FILE}), got {raw!r}")
    for field in ("r", "lora_alpha", "target_modules"):
        if field not in raw:
            raise AdapterLoadError(f"{CONFIG_FILE} lacks the field {field!r}")
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
    if raw.get("use_dora"):
        raise AdapterLoadError("DoRA adapters (use_dora: true) are not supported")
    if raw.get("modules_to_save"):
        raise AdapterLoadError(f"modules_to_save {raw['modules_to_save']!r} is not supported (must be empty)")
    if raw.get("trainable_token_indices"):
        raise AdapterLoadError("trainable_token_indices (retrained or added token embeddings) are not supported")
    if raw.get("bias", "none") != "none":
        raise AdapterLoadError(f"bias {raw['bias']!r} is not supported (must be 'none')")
    if raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise AdapterLoadError("per-module rank_pattern / alpha_pattern are not supported")
    if raw.get("fan_in_fan_out"):
        raise AdapterLoadError("fan_in_fan_out adapters are not supported")
    base_model = raw.get("base_model_name_or_path")
    return AdapterConfig(
        r=lora_rank,
        lora_alpha=lora_alpha,
        target_modules=_parse_targets(raw["target_modules"]),
        use_rslora=use_rslora,
        layers=_parse_layers(raw.get("layers_to_transform")),
        base_model_name_or_path=base_model if isinstance(base_model, str) else None,
    )


def _parse_targets(targets: Any) -> tuple[str, ...]:
    if isinstance(targets, str):
        raise AdapterLoadError(
            f"target_modules {targets!r} is a pattern; only a list of module names is supported "
            f"({', '.join(ALL_TARGETS)})"
        )
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterLoadError(f"target_modules must be a non-empty list of module names, got {targets!r}")
    modules = []
    for target in targets:
        if target in FUSED_TARGETS:
            for part in FUSED_TARGETS[target]:
                if part in targets:
                    raise AdapterLoadError(f"target_modules lists both {target!r} and its slice {part!r}")
            modules.extend(FUSED_TARGETS[target])
        elif target in ALL_TARGETS:
            modules.append(target)
        else:
            known = ", ".join((*ALL_TARGETS, *FUSED_TARGETS))
            raise AdapterLoadError(f"unknown target module {target!r}; LoRA supports {known}")
    return tuple(m for m in ALL_TARGETS if m in modules)


def _parse_layers(layers: Any) -> tuple[int, ...] | None:
    if layers is None:
        return None
    layers = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise AdapterLoadError(f"layers_to_transform must be an integer or a list of integers, got {layers!r}")
    return tuple(sorted(set(layers)))
