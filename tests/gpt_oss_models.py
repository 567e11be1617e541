"""Tiny random gpt-oss checkpoints built with transformers' GptOssConfig (attention sinks, alternating sliding-window
and full layers, YaRN, a biased top-k-softmax router, biased experts with the clamped SwiGLU), and PEFT adapters on
them: one on attention alone, one on attention and every expert (PEFT's target_parameters form). No tests here."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.lora_helpers import build_peft_adapter
from tests.moe_models import build_parameter_adapter

# Three layers: sliding (window 4), full, sliding. 4 experts of intermediate 64 (gate_up's 128 rows interleaved; MXFP4
# needs inputs in blocks of 32), top 2.
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
    max_position_embeddings=512,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=8.0,
        original_max_position_embeddings=64,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
    ),
)


def hf_config(**overrides):
    from transformers import GptOssConfig

    return GptOssConfig(**{**CONFIG, **overrides})


def build_gpt_oss_model(out_dir: Path | str, seed: int = 0, with_tokenizer: bool = False, **overrides) -> None:
    """Random weights: norms near 1, a router of std 1 that separates the experts, sinks of std 1 (each head's sink
    takes a visible share of its softmax), every bias non-zero, the rest of std 0.3."""
    from transformers import AutoModelForCausalLM

    from tests.builders import build_tokenizer, tokenizer_vocab_size

    if with_tokenizer:
        overrides = dict(vocab_size=tokenizer_vocab_size(), bos_token_id=None, eos_token_id=None, **overrides)
    model = AutoModelForCausalLM.from_config(hf_config(**overrides), dtype=torch.float32)
    if with_tokenizer:
        build_tokenizer(out_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            values = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * values)
            elif name.endswith(("router.weight", "sinks")):
                param.copy_(values)
            else:
                param.copy_(values * 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)


def build_gpt_oss_set(root: Path, with_tokenizer: bool = False) -> tuple[Path, dict[str, Path]]:
    """A model and two adapters: "a4" on attention alone (q/k/v/o, r 4) and "a8" on attention (q/o) and both stacked
    expert parameters of every layer (r 8)."""
    model_dir = root / "gpt_oss"
    build_gpt_oss_model(model_dir, with_tokenizer=with_tokenizer)
    adapters = {"a4": root / "gpt_oss-a4", "a8": root / "gpt_oss-a8"}
    build_peft_adapter(
        model_dir, adapters["a4"], r=4, lora_alpha=8, seed=1, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")
    )
    build_parameter_adapter(model_dir, adapters["a8"], r=8, lora_alpha=16, target_modules=("q_proj", "o_proj"), seed=2)
    return model_dir, adapters
