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

    from tests.builders import build_tokenizer, tokenizer_vocab_size
    from tests.moe_models import fill_random_weights

    if with_tokenizer:
        overrides = dict(vocab_size=tokenizer_vocab_size(), bos_token_id=None, eos_token_id=None, **overrides)
    model = AutoModelForCausalLM.from_config(hf_config(**overrides), dtype=torch.float32)
    if with_tokenizer:
        build_tokenizer(out_dir)
    generator = torch.Generator().manual_seed(seed)
    fill_random_weights(model, generator)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.5 * torch.randn(buffer.shape, generator=generator))
    model.save_pretrained(out_dir, safe_serialization=True)


MLA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def build_mla_expert_adapter(model_dir: Path | str, out_dir: Path | str, *, r: int, lora_alpha: float, seed: int,
                             init_std: float = 0.2, with_mlps: bool = False) -> None:
    """PEFT's per-expert form: every latent-attention linear of every layer, and each routed expert's gate/up/down
    of the MoE layers (`mlp.experts.N.gate_proj`), A and B entries of std `init_std`; `with_mlps`: the dense layers'
    MLP and the shared experts' too, as an adapter trained on DeepSeek's own per-expert modules holds them (PEFT on
    transformers 5 converts gate/up/down to the stacked experts alone, so no peft reference reads these)."""
    import json

    from tests.expert_adapters import save_random_adapter

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    shapes = {"q_a_proj": (hidden, cfg["q_lora_rank"]), "q_b_proj": (cfg["q_lora_rank"], heads * qk_head),
              "kv_a_proj_with_mqa": (hidden, cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]),
              "kv_b_proj": (cfg["kv_lora_rank"], heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])),
              "o_proj": (heads * cfg["v_head_dim"], hidden)}
    inter, dense = cfg["moe_intermediate_size"], cfg["intermediate_size"]
    expert_shapes = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    dense_shapes = {"gate_proj": (hidden, dense), "up_proj": (hidden, dense), "down_proj": (dense, hidden)}
    shared = inter * cfg["n_shared_experts"]
    shared_shapes = {"gate_proj": (hidden, shared), "up_proj": (hidden, shared), "down_proj": (shared, hidden)}
    modules: dict[str, tuple[int, int]] = {}  # module path -> (in, out)
    for layer in range(cfg["num_hidden_layers"]):
        base = f"model.layers.{layer}"
        for module, shape in shapes.items():
            modules[f"{base}.self_attn.{module}"] = shape
        if layer < cfg["first_k_dense_replace"]:
            for module, shape in dense_shapes.items() if with_mlps else ():
                modules[f"{base}.mlp.{module}"] = shape
            continue
        for module, shape in shared_shapes.items() if with_mlps else ():
            modules[f"{base}.mlp.shared_experts.{module}"] = shape
        for expert in range(cfg["n_routed_experts"]):
            for module, shape in expert_shapes.items():
                modules[f"{base}.mlp.experts.{expert}.{module}"] = shape
    save_random_adapter(out_dir, modules, r=r, lora_alpha=lora_alpha, seed=seed, init_std=init_std,
                        target_modules=[*shapes, *expert_shapes])


def build_mla_set(root: Path, with_tokenizer: bool = False) -> tuple[Path, dict[str, Path]]:
    """A model and two adapters on it, both on every latent-attention linear (kv_b_proj included): "a4" in the
    per-expert form (all routed experts), "a8" in PEFT's target_parameters form (the stacked experts) with its own
    rank and alpha on kv_b_proj (patterns)."""
    from tests.moe_models import build_parameter_adapter

    model_dir = root / "deepseek_v3"
    build_mla_model(model_dir, with_tokenizer=with_tokenizer)
    adapters = {"a4": root / "deepseek_v3-a4", "a8": root / "deepseek_v3-a8"}
    build_mla_expert_adapter(model_dir, adapters["a4"], r=4, lora_alpha=8, seed=1)
    build_parameter_adapter(model_dir, adapters["a8"], r=8, lora_alpha=16, target_modules=MLA_TARGETS, seed=2,
                            rank_pattern={r".*\.kv_b_proj": 4}, alpha_pattern={r".*\.kv_b_proj": 12})
    return model_dir, adapters
