"""Tiny random Gemma 2 / Gemma 3 text checkpoints built with transformers' own config classes (no tests here)."""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 8  # the local layers' sliding window: prompts of 3x this reach well past it
TINY_GEMMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,  # not head_dim, so the scale is observable
    max_position_embeddings=512,
    sliding_window=WINDOW,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# Local, global, local, local: both kinds, and two local layers in a row.
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]


def gemma_config(family: str, **overrides):
    """The transformers config of a tiny `family` ("gemma2" or "gemma3_text") model."""
    from transformers import Gemma2Config, Gemma3TextConfig  # here: the TP test's ranks import this module

    fields = {**TINY_GEMMA, **overrides}
    if family == "gemma2":
        # Small caps, so the soft-capping changes the scores and logits of these random weights.
        return Gemma2Config(**fields, layer_types=LAYER_TYPES, attn_logit_softcapping=2.0,
                            final_logit_softcapping=8.0)  # fmt: skip
    if family == "gemma3_text":
        rope = {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        }
        return Gemma3TextConfig(**fields, layer_types=LAYER_TYPES, rope_parameters=rope)
    raise ValueError(f"unknown Gemma family {family!r}")


def build_tiny_gemma(out_dir: Path | str, family: str, seed: int = 0, **overrides) -> None:
    """Random non-zero weights, norms included (their `1 + w` is then not 1), saved as a safetensors checkpoint;
    `overrides`: config fields (a vocab_size to match a tokenizer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(gemma_config(family, **overrides), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            std = 0.2 if name.endswith("norm.weight") else 0.3
            param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(out_dir, safe_serialization=True)
