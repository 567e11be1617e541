"""Tiny random hybrid checkpoints (Gated DeltaNet and gated attention layers: Qwen3.5 text, Qwen3.5-MoE text,
Qwen3-Next) built with transformers' config classes, and PEFT adapters on them (no tests here)."""

from __future__ import annotations

from pathlib import Path

import torch

QWEN3_5_TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,  # linear, linear, full, linear
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=40)
ARCHS = {  # model_type -> its config's fields beyond QWEN3_5_TEXT
    "qwen3_5_text": {},
    "qwen3_5_moe_text": _MOE,
    # layer 1 dense (mlp_only_layers), with a dense MLP size unlike the experts'
    "qwen3_next": dict(_MOE, mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True),
}


def hf_config(arch: str = "qwen3_5_text", **overrides):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    cls = {"qwen3_5_text": Qwen3_5TextConfig, "qwen3_5_moe_text": Qwen3_5MoeTextConfig,
           "qwen3_next": Qwen3NextConfig}[arch]  # fmt: skip
    return cls(**{**QWEN3_5_TEXT, **ARCHS[arch], **overrides})


def build_hybrid_model(out_dir: Path | str, seed: int = 0, with_tokenizer: bool = False, arch: str = "qwen3_5_text",
                       **overrides) -> None:  # fmt: skip
    """Random weights in fp32: (1 + w) norms' offsets and the gated norm near their identity, decays that neither
    vanish nor explode (A = exp(A_log) in [0.5, 4.5], dt_bias ~ 1), every other weight ~ N(0, 0.3);
    with_tokenizer: the tests' tiny tokenizer beside it (and its vocabulary), for a server."""
    from transformers import AutoModelForCausalLM

    if with_tokenizer:
        from tests.builders import build_tokenizer, tokenizer_vocab_size

        overrides = {"vocab_size": tokenizer_vocab_size(), **overrides}
        build_tokenizer(out_dir)
    model = AutoModelForCausalLM.from_config(hf_config(arch, **overrides), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            values = torch.randn(param.shape, generator=generator)
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.1 * values)
            elif name.endswith("norm.weight"):  # stored as an offset from 1
                param.copy_(0.1 * values)
            elif name.endswith("A_log"):
                param.copy_(torch.rand(param.shape, generator=generator).mul(4.0).add(0.5).log())
            elif name.endswith("dt_bias"):
                param.copy_(1.0 + 0.1 * values)
            elif name.endswith("mlp.gate.weight"):  # the router: experts clearly apart
                param.copy_(values)
            else:
                param.copy_(values * 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)


ADAPTERS = {  # name -> (rank, alpha, targets): mixed ranks, one adapter on both layer kinds, one on the DeltaNet only
    "all": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                    "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")),
    "linear": (4, 12, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "down_proj")),
}
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def adapter_targets(arch: str, name: str) -> tuple[str, ...]:
    """ADAPTERS[name]'s targets as the arch names them: Qwen3-Next's fused in_proj_qkvz / in_proj_ba. In the MoE
    archs the MLP names reach the shared expert (`mlp.shared_expert.*`) and Qwen3-Next's dense layer, the routed
    experts take build_hybrid_adapter's `experts`; but PEFT on transformers 5 rewrites Qwen3-Next's MLP names into
    its stacked experts' parameters, so there none is named (build_next_expert_adapter writes that case by hand)."""
    targets = ADAPTERS[name][2]
    if arch == "qwen3_next":
        targets = tuple(t for t in targets if t not in MLP_TARGETS)
    if arch == "qwen3_next":
        fused = {"in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz", "in_proj_b": "in_proj_ba",
                 "in_proj_a": "in_proj_ba"}  # fmt: skip
        targets = tuple(dict.fromkeys(fused.get(t, t) for t in targets))
    return targets


EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def build_hybrid_adapter(base_dir: Path | str, out_dir: Path | str, name: str, seed: int = 0,
                         arch: str = "qwen3_5_text", experts: bool = False) -> None:  # fmt: skip
    """A PEFT adapter with random A and B (so every target changes the outputs); experts: also LoRA on the MoE
    archs' routed experts (PEFT's target_parameters over the stacked expert tensors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    r, alpha, _ = ADAPTERS[name]
    targets = adapter_targets(arch, name)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                  target_parameters=EXPERT_PARAMETERS if experts else None,
                                                  init_lora_weights=False, lora_dropout=0.0))  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in sorted(peft_model.named_parameters()):
            if "lora_" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    peft_model.save_pretrained(str(out_dir))


def build_next_expert_adapter(model_dir: Path | str, out_dir: Path | str, *, r: int, lora_alpha: float,
                              seed: int) -> None:  # fmt: skip
    """A Qwen3-Next adapter as PEFT saves one trained on transformers 4's modules: the attention layers' k/v/o, the
    DeltaNet's fused (grouped) in_proj_qkvz and out_proj, the dense layer's MLP, and each MoE layer's routed experts
    one by one (`mlp.experts.E.gate_proj`) beside its shared expert (`mlp.shared_expert.gate_proj`). PEFT on
    transformers 5 converts the MLP names to the stacked experts, dropping the rest: expert_adapters.merged_reference
    is its reference."""
    import json

    from tests.expert_adapters import save_random_adapter

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, head_dim = cfg["hidden_size"], cfg["head_dim"]
    q_size, kv_size = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value_dim = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    attn = {"k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size), "o_proj": (q_size, hidden)}
    linear = {"in_proj_qkvz": (hidden, 2 * key_dim + 2 * value_dim), "out_proj": (value_dim, hidden)}

    def mlp(inter: int) -> dict[str, tuple[int, int]]:
        return {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}

    modules: dict[str, tuple[int, int]] = {}  # module path -> (in, out)
    for layer, kind in enumerate(cfg["layer_types"]):
        base = f"model.layers.{layer}"
        mixer = linear if kind == "linear_attention" else attn
        parent = "linear_attn" if kind == "linear_attention" else "self_attn"
        modules.update({f"{base}.{parent}.{module}": shape for module, shape in mixer.items()})
        if layer in cfg["mlp_only_layers"]:
            modules.update({f"{base}.mlp.{module}": shape for module, shape in mlp(cfg["intermediate_size"]).items()})
            continue
        for expert in range(cfg["num_experts"]):
            modules.update({f"{base}.mlp.experts.{expert}.{module}": shape
                            for module, shape in mlp(cfg["moe_intermediate_size"]).items()})  # fmt: skip
        shared = mlp(cfg["shared_expert_intermediate_size"])
        modules.update({f"{base}.mlp.shared_expert.{module}": shape for module, shape in shared.items()})
    save_random_adapter(out_dir, modules, r=r, lora_alpha=lora_alpha, seed=seed, init_std=0.15,
                        target_modules=[*attn, *linear, "gate_proj", "up_proj", "down_proj"])  # fmt: skip
