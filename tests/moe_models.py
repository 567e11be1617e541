"""Tiny random MoE checkpoints (Mixtral, OLMoE, Qwen3-MoE) built with transformers' config classes, and PEFT expert
adapters on them in both of PEFT's forms (no tests here)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.expert_adapters import build_expert_module_adapter

ARCHS = ("mixtral", "olmoe", "qwen3_moe")
_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    num_experts_per_tok=2,
)
CONFIGS = {
    "mixtral": dict(intermediate_size=96, num_local_experts=4),
    "olmoe": dict(intermediate_size=96, num_experts=4, norm_topk_prob=False),
    # layer 1 dense (mlp_only_layers), with a dense MLP size unlike the experts'
    "qwen3_moe": dict(intermediate_size=160, moe_intermediate_size=96, num_experts=4, norm_topk_prob=True,
                      mlp_only_layers=[1], head_dim=16),
}


def hf_config(arch: str, **overrides):
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    cls = {"mixtral": MixtralConfig, "olmoe": OlmoeConfig, "qwen3_moe": Qwen3MoeConfig}[arch]
    return cls(**{**_COMMON, **CONFIGS[arch], **overrides})


def build_moe_model(out_dir: Path | str, arch: str, seed: int = 0, with_tokenizer: bool = False, **config) -> None:
    """Random weights, norms near 1, a router that separates the experts clearly; with_tokenizer: the tests' tiny
    tokenizer beside it (and its vocabulary), for a server; `config`: overrides of the config (num_hidden_layers...)."""
    from transformers import AutoModelForCausalLM

    from tests.builders import build_tokenizer, tokenizer_vocab_size

    overrides = dict(vocab_size=tokenizer_vocab_size(), bos_token_id=None, eos_token_id=None) if with_tokenizer else {}
    model = AutoModelForCausalLM.from_config(hf_config(arch, **overrides, **config), dtype=torch.float32)
    if with_tokenizer:
        build_tokenizer(out_dir)
    fill_random_weights(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(out_dir, safe_serialization=True)


@torch.no_grad()
def fill_random_weights(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Norms near 1, a router (`gate.weight`) of std 1 that separates the experts clearly, the rest of std 0.3."""
    for name, param in sorted(model.named_parameters()):
        values = torch.randn(param.shape, generator=generator)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * values)
        elif name.endswith("gate.weight"):  # the router
            param.copy_(values)
        else:
            param.copy_(values * 0.3)


def build_parameter_adapter(model_dir: Path | str, out_dir: Path | str, *, r: int, lora_alpha: float,
                            target_modules: tuple[str, ...], seed: int, **patterns) -> None:
    """PEFT's `target_parameters` form over the fused expert tensors (and `target_modules` on attention), built by
    peft itself; `patterns`: rank_pattern / alpha_pattern."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules) or None,
                        target_parameters=params, init_lora_weights=False, **patterns)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # peft's B init is small for target_parameters; make every product visible
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(2.0)
    peft_model.save_pretrained(out_dir)


def build_moe_set(root: Path, arch: str, with_tokenizer: bool = False, **config) -> tuple[Path, dict[str, Path]]:
    """A model and two adapters on it: "a4" in the per-expert form (attention q/v, all experts), "a8" in the
    target_parameters form (attention q/o, stacked experts) whose gate_up has its own rank and alpha (patterns)."""
    model_dir = root / arch
    build_moe_model(model_dir, arch, with_tokenizer=with_tokenizer, **config)
    adapters = {"a4": root / f"{arch}-a4", "a8": root / f"{arch}-a8"}
    build_expert_module_adapter(model_dir, adapters["a4"], r=4, lora_alpha=8, seed=1)
    build_parameter_adapter(model_dir, adapters["a8"], r=8, lora_alpha=16, target_modules=("q_proj", "o_proj"), seed=2,
                            rank_pattern={r".*\.gate_up_proj": 4}, alpha_pattern={r".*\.gate_up_proj": 12})
    return model_dir, adapters
