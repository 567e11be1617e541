from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "olmoe", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    pass


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)  # scaling parameters of rope_type, as in the HF config


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts fields of a config.json (Mixtral, OLMoE, Qwen3-MoE)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # of each expert
    renormalize: bool  # the top-k weights rescaled to sum to 1 (Mixtral always; OLMoE/Qwen3-MoE: norm_topk_prob)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP of ModelConfig.intermediate_size instead

    @classmethod
    def from_dict(cls, hf: dict[str, Any], model_type: str) -> MoEConfig | None:
        if model_type not in _MOE_MODEL_TYPES:
            return None
        num_experts = hf.get("num_local_experts") or hf.get("num_experts")
        num_layers = hf["num_hidden_layers"]
        dense_layers: tuple[int, ...] = ()
        if model_type == "qwen3_moe":  # Qwen3MoeDecoderLayer's rule
            step = hf.get("decoder_sparse_step", 1) or 1
            only = set(hf.get("mlp_only_layers") or ())
            dense_layers = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
        if model_type == "olmoe" and hf.get("clip_qkv") is not None:
            raise ModelConfigError(f"OLMoE with clip_qkv={hf['clip_qkv']} is not supported")
        return cls(
            num_experts=num_experts,
            top_k=hf["num_experts_per_tok"],
            intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
            renormalize=model_type == "mixtral" or bool(hf.get("norm_topk_prob", False)),
            dense_layers=dense_layers,
        )


_MOE_MODEL_TYPES = ("mixtral", "olmoe", "qwen3_moe")


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
    initializer_range: float = 0.02  # std of HF's weight init (--load-format dummy draws with it)
    moe: MoEConfig | None = None  # None: a dense model

    @property
    def max_context_length(self) -> int:
        # Sliding-window attention is not implemented; within the window it equals full attention.
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, model_dir: str, overrides: dict[str, Any] | None = None) -> ModelConfig:
        """config.json with `overrides` (--hf-overrides) merged in before any field is read."""
        if not os.path.isdir(model_dir):
            raise ModelConfigError(f"model directory {model_dir!r} does not exist")
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ModelConfigError(f"no config.json in model directory {model_dir!r}")
        with open(path) as f:
            return cls.from_dict(merge_overrides(json.load(f), overrides or {}))

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
        attention_bias = bool(hf.get("attention_bias", False))
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
            rope=_read_rope(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and none on o_proj; Llama's attention_bias covers all four.
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=not is_qwen2 and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=_read_sliding_window(hf, model_type),
            checkpoint_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            initializer_range=hf.get("initializer_range", 0.02),
            moe=MoEConfig.from_dict(hf, model_type),
        )


def merge_overrides(hf: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """hf with overrides merged in; an object overriding an object merges key by key (as vLLM's --hf-overrides), so
    '{"rope_scaling": {"factor": 4.0}}' changes one scaling parameter. Neither input is changed."""
    merged = dict(hf)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_rope(hf: dict[str, Any]) -> RopeConfig:
    # transformers 5: `rope_parameters` holds rope_theta and the scaling; transformers 4: top-level
    # `rope_theta` plus an optional `rope_scaling` dict whose kind is `rope_type` (or the older `type`).
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "full_attention" in params and isinstance(params["full_attention"], dict):  # per-layer-type form
        params = dict(params["full_attention"])
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor") or 1.0
    if not math.isclose(partial, 1.0):
        raise ModelConfigError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported")
    needed = {"linear": ("factor",), "llama3": _LLAMA3_KEYS}.get(rope_type, ())
    missing = [key for key in needed if key not in params]
    if missing:
        raise ModelConfigError(f"rope type {rope_type!r} is missing {', '.join(missing)} in the model config")
    return RopeConfig(theta=float(theta), rope_type=rope_type, params=params)


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _read_sliding_window(hf: dict[str, Any], model_type: str) -> int | None:
    # Qwen2, Qwen3 and Qwen3-MoE record a window they do not use
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
        return None
    return hf.get("sliding_window") or None
