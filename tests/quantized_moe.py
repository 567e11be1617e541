"""A tiny Qwen3-MoE checkpoint quantized in an expert format (tests/quantize_checkpoint.py quantizes attention, the
dense MLP and every expert; the router stays plain), beside the same weights dequantized into a plain checkpoint (the
reference), and two adapters on it: "a4" on attention alone, "a8" on attention and every expert (PEFT's per-expert
form). No tests here."""

from __future__ import annotations

import json
from pathlib import Path

from tests.expert_adapters import build_expert_module_adapter, save_random_adapter
from tests.moe_models import build_moe_model
from tests.quantize_checkpoint import write_quantized

# FP8 in 128x128 blocks (one partial block per projection here, cut by TP=2), AWQ's INT4 with zero points,
# compressed-tensors' symmetric INT4
EXPERT_FORMATS = ("fp8-block", "awq-4bit", "ct-w4a16")
GROUP_SIZE = 16  # whole groups in each TP=2 shard of the experts' 96-wide intermediate


def build_moe_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, q_size = cfg["hidden_size"], cfg["num_attention_heads"] * cfg["head_dim"]
    attention = {f"model.layers.{layer}.self_attn.{name}": shape for layer in range(cfg["num_hidden_layers"])
                 for name, shape in (("q_proj", (hidden, q_size)), ("o_proj", (q_size, hidden)))}  # fmt: skip
    adapters = {"a4": root / "attention-a4", "a8": root / "experts-a8"}
    save_random_adapter(adapters["a4"], attention, r=4, lora_alpha=8, seed=5, init_std=0.2,
                        target_modules=["q_proj", "o_proj"])  # fmt: skip
    build_expert_module_adapter(model_dir, adapters["a8"], r=8, lora_alpha=16, seed=6)
    return adapters


def build_quantized_moe(
    root: Path, formats: tuple[str, ...] = EXPERT_FORMATS, with_tokenizer: bool = False
) -> tuple[dict[str, tuple[Path, Path]], dict[str, Path]]:
    """({format: (quantized dir, dequantized dir)}, adapters)."""
    plain = root / "qwen3_moe"
    build_moe_model(plain, "qwen3_moe", with_tokenizer=with_tokenizer)
    checkpoints = {}
    for fmt in formats:
        checkpoints[fmt] = (root / f"qwen3_moe-{fmt}", root / f"qwen3_moe-{fmt}-dequantized")
        write_quantized(plain, fmt, *checkpoints[fmt], group_size=GROUP_SIZE)
    return checkpoints, build_moe_adapters(plain, root)
