"""Tiny random DeepSeek-V3 checkpoints (latent attention, grouped sigmoid router, shared experts, a dense first
layer) built with transformers' DeepseekV3Config, and PEFT adapters on them (no tests here)."""

from __future__ import annotations

from pathlib import Path

import torch

# Two layers: layer 0 dense (first_k_dense_replace), layer 1 MoE with 8 routed experts in 4 groups, 2 groups chosen.
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    max_position_embeddings=512,
    rope_interleave=True,
    # yarn with DeepSeek's mscale and mscale_all_dim, as the published configs set it
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                         beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
)


def hf_config(**overrides):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{**CONFIG, **overrides})


def build_mla_model(out_dir: Path | str, seed: int = 0, with_tokenizer: bool = False, **overrides) -> None:
    """Random weights, norms near 1, a router that separates the experts clearly, a visible correction bias."""
    from transformers import AutoModelForCausalLM

    from scripts.demo.builders import build_tokenizer, tokenizer_vocab_size

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
            elif name.endswith("gate.weight"):  # the router
                param.copy_(values)
            else:
                param.copy_(values * 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.5 * torch.randn(buffer.shape, generator=generator))
    model.save_pretrained(out_dir, safe_serialization=True)
