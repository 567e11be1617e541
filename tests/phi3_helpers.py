"""Tiny random Phi-3 checkpoints built with transformers' Phi3Config (their adapters: lora_helpers.build_peft_adapter).
No tests here."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_PHI3 = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    sliding_window=None,
)
# Phi-4-mini's form, scaled down: partial rotary (12 of 16 features), longrope with its original length at the top
# level, tied embeddings. max / original = 8 gives an attention factor of sqrt(1 + ln 8 / ln 64).
NUM_FREQS = 6
PHI4_MINI_LIKE = dict(
    partial_rotary_factor=0.75,
    original_max_position_embeddings=64,
    rope_scaling={
        "type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(NUM_FREQS)],
        "long_factor": [1.0 + 2.5 * i for i in range(NUM_FREQS)],
    },
    tie_word_embeddings=True,
)
# The fused modules and the two that are not: all a PEFT adapter can target in Phi-3's decoder layers.
PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def build_tiny_phi3(out_dir: Path | str, seed: int = 0, **overrides) -> None:
    """Every weight random and non-zero (norms 1), so each one shows in the outputs."""
    from transformers import AutoModelForCausalLM, Phi3Config

    config = Phi3Config(**{**TINY_PHI3, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            values = torch.randn(param.shape, generator=generator) * 0.3
            param.copy_(torch.ones_like(param) if name.endswith("norm.weight") else values)
    model.save_pretrained(out_dir, safe_serialization=True)
