"""PEFT LoRA adapters on a MoE checkpoint in PEFT's per-expert form, as adapters trained on transformers 4 are saved
(layers.N.<parent>.experts.E.<module> lora_A/B, beside attention modules), written by hand: transformers 5 models have
no per-expert modules to build them on with peft. Shapes come from the checkpoint's config.json. merged_reference is
the HF model such an adapter should equal."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

# the per-expert module names PEFT adapters of each family name (transformers 4's modules)
EXPERT_MODULES = {
    "mixtral": ("w1", "w3", "w2"),
    "olmoe": ("gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
}
# where a per-expert adapter's expert weights live in each family's checkpoints
EXPERT_PARENT = {"mixtral": "block_sparse_moe", "olmoe": "mlp", "qwen3_moe": "mlp"}


def build_expert_module_adapter(model_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, r: int,
                                lora_alpha: float, seed: int, attn_modules: tuple[str, ...] = ("q_proj", "v_proj"),
                                init_std: float = 0.2) -> None:
    """Attention `attn_modules` and every sparse layer's experts (A and B entries of std `init_std`)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    arch = cfg["model_type"]
    hidden, inter = cfg["hidden_size"], cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_size, kv_size = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    attn_shapes = {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
                   "o_proj": (q_size, hidden)}
    gate, up, down = EXPERT_MODULES[arch]
    expert_shapes = {gate: (hidden, inter), up: (hidden, inter), down: (inter, hidden)}
    num_experts = cfg.get("num_local_experts") or cfg["num_experts"]
    dense = set(cfg.get("mlp_only_layers") or ())
    modules: dict[str, tuple[int, int]] = {}  # module path -> (in, out)
    for layer in range(cfg["num_hidden_layers"]):
        base = f"model.layers.{layer}"
        for module in attn_modules:
            modules[f"{base}.self_attn.{module}"] = attn_shapes[module]
        if layer in dense:
            # A dense layer's MLP has the experts' module names, so transformers 4's PEFT targeted it too; but on
            # transformers 5 PEFT converts the adapter to the stacked experts only, and the reference would drop these.
            continue
        for expert in range(num_experts):
            for module, shape in expert_shapes.items():
                modules[f"{base}.{EXPERT_PARENT[arch]}.experts.{expert}.{module}"] = shape
    save_random_adapter(out_dir, modules, r=r, lora_alpha=lora_alpha, seed=seed, init_std=init_std,
                        target_modules=[*attn_modules, gate, up, down])


def save_random_adapter(out_dir: str | os.PathLike[str], modules: dict[str, tuple[int, int]], *, r: int,
                        lora_alpha: float, seed: int, init_std: float, target_modules: list[str]) -> None:
    """A PEFT adapter file pair: for each module path, in order, A (r, in) and B (out, r) of std `init_std`."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, (in_dim, out_dim) in modules.items():
        tensors[f"base_model.model.{path}.lora_A.weight"] = torch.randn(r, in_dim, generator=gen) * init_std
        tensors[f"base_model.model.{path}.lora_B.weight"] = torch.randn(out_dim, r, generator=gen) * init_std
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": lora_alpha, "lora_dropout": 0.0, "bias": "none",
              "target_modules": target_modules, "task_type": "CAUSAL_LM",
              "base_model_name_or_path": None, "rank_pattern": {}, "alpha_pattern": {}}
    (out_dir / "adapter_config.json").write_text(json.dumps(config))


def merged_reference(model_dir: Path | str, adapter_dir: Path | str):
    """HF's model with a per-expert adapter's every product merged into its weights (W += scale · B·A), the
    reference for what PEFT does not load on transformers 5 (shared experts: it converts their names away)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with safe_open(str(Path(adapter_dir) / "adapter_model.safetensors"), "pt") as f, torch.no_grad():
        for key_a in [k for k in f.keys() if k.endswith(".lora_A.weight")]:
            delta = scale * f.get_tensor(key_a.replace("lora_A", "lora_B")) @ f.get_tensor(key_a)  # (out, in)
            path = key_a.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            parent, _, module = path.rpartition(".")
            if ".experts." in path:  # one routed expert of the stacked (experts, out, in) tensors
                experts, _, expert = parent.rpartition(".")
                stacked = model.get_submodule(experts)
                inter = stacked.down_proj.shape[-1]
                rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter), "down_proj": slice(None)}
                target = stacked.down_proj if module == "down_proj" else stacked.gate_up_proj
                target[int(expert), rows[module]] += delta
            else:
                model.get_submodule(path).weight += delta
    return model
