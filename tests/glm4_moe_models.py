"""Tiny random GLM-4.5 checkpoints (GQA attention with q/k/v biases and partial rotary, optional per-head q/k norms;
DeepSeek-V3's grouped sigmoid router, shared experts and a dense first layer) built with transformers'
Glm4MoeConfig, and two PEFT adapters on them (no tests here)."""

from __future__ import annotations

from pathlib import Path

import torch

# Two layers: layer 0 dense (first_k_dense_replace), layer 1 MoE with 8 routed experts in 4 groups, 2 groups chosen;
# half of each 16-wide head rotated.
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    attention_bias=True,
    use_qk_norm=True,
    max_position_embeddings=2048,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")  # the dense layer's MLP and every MoE layer's shared experts


def hf_config(**overrides):
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**{**CONFIG, **overrides})


def build_glm4_moe_model(out_dir: Path | str, seed: int = 0, with_tokenizer: bool = False, **overrides) -> None:
    """Random weights (biases too), norms near 1, a router that separates the experts clearly, a visible correction
    bias."""
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


def build_glm4_moe_expert_adapter(
    model_dir: Path | str, out_dir: Path | str, *, r: int, lora_alpha: float, seed: int, init_std: float = 0.2
) -> None:
    """PEFT's per-expert form on attention (q/k/v/o), every routed expert's gate/up/down (`mlp.experts.N.gate_proj`),
    the shared experts' (`mlp.shared_experts.gate_proj`) and the dense layer's MLP. PEFT on transformers 5 converts
    gate/up/down to the stacked experts alone, so no peft reference reads the shared experts' and dense MLP's terms:
    tests/mla_models.py's merged_reference is this adapter's reference."""
    import json

    from tests.expert_adapters import save_random_adapter

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, head_dim = cfg["hidden_size"], cfg["head_dim"]
    q_size, kv_size = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    attention = {
        "q_proj": (hidden, q_size),
        "k_proj": (hidden, kv_size),
        "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden),
    }

    def mlp(inter: int) -> dict[str, tuple[int, int]]:
        return {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}

    modules: dict[str, tuple[int, int]] = {}  # module path -> (in, out)
    for layer in range(cfg["num_hidden_layers"]):
        base = f"model.layers.{layer}"
        modules.update({f"{base}.self_attn.{name}": shape for name, shape in attention.items()})
        if layer < cfg["first_k_dense_replace"]:
            modules.update({f"{base}.mlp.{name}": shape for name, shape in mlp(cfg["intermediate_size"]).items()})
            continue
        shared = mlp(cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
        modules.update({f"{base}.mlp.shared_experts.{name}": shape for name, shape in shared.items()})
        for expert in range(cfg["n_routed_experts"]):
            modules.update(
                {
                    f"{base}.mlp.experts.{expert}.{name}": shape
                    for name, shape in mlp(cfg["moe_intermediate_size"]).items()
                }
            )
    save_random_adapter(
        out_dir, modules, r=r, lora_alpha=lora_alpha, seed=seed, init_std=init_std, target_modules=[*ATTENTION, *MLP]
    )


def build_glm4_moe_set(root: Path, with_tokenizer: bool = False, **overrides) -> tuple[Path, dict[str, Path]]:
    """A model and two adapters: "a4" on attention alone (q/k/v/o, built by peft), "a8" on attention, every routed
    expert, the shared experts and the dense layer's MLP (per-expert form, build_glm4_moe_expert_adapter)."""
    from tests.lora_helpers import build_peft_adapter

    model_dir = root / "glm4_moe"
    build_glm4_moe_model(model_dir, with_tokenizer=with_tokenizer, **overrides)
    adapters = {"a4": root / "glm4_moe-a4", "a8": root / "glm4_moe-a8"}
    build_peft_adapter(model_dir, adapters["a4"], r=4, lora_alpha=8, target_modules=ATTENTION, seed=1)
    build_glm4_moe_expert_adapter(model_dir, adapters["a8"], r=8, lora_alpha=16, seed=2)
    return model_dir, adapters
