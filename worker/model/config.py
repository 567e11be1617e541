from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "phi3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


class ModelConfigError(ValueError):
    pass


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    # Scaling parameters of rope_type, as in the HF config; `original_max_position_embeddings` filled in where
    # transformers fills it in (llama3, yarn, longrope).
    params: dict[str, Any] = field(default_factory=dict)
    partial_rotary_factor: float = 1.0  # the leading fraction of each head that is rotated (Phi-4-mini: 0.75)
    max_position_embeddings: int = 2048  # the model's, which dynamic, yarn and longrope scale against

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)  # as transformers rounds it


@dataclass(frozen=True)
class ModelConfig:
    """The fields of an HF config.json that a Llama-family model needs, read in both transformers 4 and 5 forms."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None  # None = every layer attends to the whole context
    checkpoint_dtype: str | None

    @property
    def max_context_length(self) -> int:
        # Sliding-window attention is not implemented; within the window it equals full attention.
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, model_dir: str) -> ModelConfig:
        if not os.path.isdir(model_dir):
            raise ModelConfigError(f"model directory {model_dir!r} does not exist")
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ModelConfigError(f"no config.json in model directory {model_dir!r}")
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"unsupported hidden_act {hf['hidden_act']!r}; only silu is implemented")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        # Phi-3's linears have no biases whatever attention_bias says (its HF code builds them without).
        attention_bias = bool(hf.get("attention_bias", False)) and model_type != "phi3"
        is_qwen2 = model_type == "qwen2"
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=_read_rope(hf, model_type, head_dim),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and none on o_proj; Llama's attention_bias covers all four.
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=not is_qwen2 and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)) and model_type != "phi3",
            sliding_window=_read_sliding_window(hf, model_type),
            checkpoint_dtype=hf.get("dtype") or hf.get("torch_dtype"),
        )


def _read_rope(hf: dict[str, Any], model_type: str, head_dim: int) -> RopeConfig:
    # transformers 5: `rope_parameters` holds rope_theta and the scaling; transformers 4: top-level
    # `rope_theta` plus an optional `rope_scaling` dict whose kind is `rope_type` (or the older `type`).
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "full_attention" in params and isinstance(params["full_attention"], dict):  # per-layer-type form
        params = dict(params["full_attention"])
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if model_type == "phi3" and rope_type in ("su", "yarn"):  # Phi3Config's older names of longrope
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor") or 1.0
    if not 0.0 < partial <= 1.0 or int(head_dim * partial) % 2:
        raise ModelConfigError(f"partial_rotary_factor {partial} must rotate an even part of head_dim {head_dim}")
    max_positions = hf.get("max_position_embeddings", 2048)
    if rope_type in ("llama3", "yarn", "longrope"):
        # As transformers' standardize_rope_params: a top-level original_max_position_embeddings (Phi-3 keeps it
        # there; Phi3Config defaults it to 4096) wins over the scaling dict's, which defaults to the model's maximum.
        top_level = hf.get("original_max_position_embeddings") or (4096 if model_type == "phi3" else None)
        if top_level is not None:
            params["original_max_position_embeddings"] = top_level
        else:
            params.setdefault("original_max_position_embeddings", max_positions)
    missing = [key for key in _NEEDED_KEYS.get(rope_type, ()) if params.get(key) is None]
    if missing:
        raise ModelConfigError(f"rope type {rope_type!r} is missing {', '.join(missing)} in the model config")
    if rope_type == "longrope":
        num_freqs = int(head_dim * partial) // 2
        for key in ("short_factor", "long_factor"):
            if len(params[key]) != num_freqs:
                raise ModelConfigError(f"longrope {key} has {len(params[key])} values, expected {num_freqs}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        params=params,
        partial_rotary_factor=float(partial),
        max_position_embeddings=max_positions,
    )


_NEEDED_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("original_max_position_embeddings",),  # factor may be absent: max / original then
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _read_sliding_window(hf: dict[str, Any], model_type: str) -> int | None:
    if model_type == "qwen2" and not hf.get("use_sliding_window", False):  # Qwen2 records a window it does not use
        return None
    return hf.get("sliding_window") or None
