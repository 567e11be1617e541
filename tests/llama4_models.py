"""Tiny random Llama 4 checkpoints built with transformers' Llama4TextConfig / Llama4Config, and PEFT adapters on
them (no tests here)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Four layers: 0 and 2 dense (interleave_moe_layer_step 2), 1 and 3 MoE (4 experts, top-1, a shared expert); layer 1
# NoPE (global, temperature-tuned from position 3 on: floor_scale 4), the others RoPE layers attending within chunks
# of 6 tokens (pages hold 4: chunks and pages do not line up).
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=48,
    intermediate_size_mlp=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    no_rope_layers=[1, 0, 1, 1],
    attention_chunk_size=6,
    attn_temperature_tuning=True,
    floor_scale=4,
    attn_scale=0.5,
    use_qk_norm=True,
    max_position_embeddings=512,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
EXPERT_PARAMETERS = ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]


def hf_config(**overrides):
    from transformers import Llama4TextConfig

    return Llama4TextConfig(**{**CONFIG, **overrides})


def build_llama4_model(out_dir: Path | str, seed: int = 0, with_tokenizer: bool = False, **overrides) -> None:
    """Random weights: norms near 1, a router of std 1 (its experts clearly apart), the rest of std 0.3;
    with_tokenizer: the tests' tiny tokenizer beside it (and its vocabulary), for a server."""
    from transformers import AutoModelForCausalLM

    from tests.builders import build_tokenizer, tokenizer_vocab_size

    if with_tokenizer:
        overrides = dict(vocab_size=tokenizer_vocab_size(), **overrides)
        build_tokenizer(out_dir)
    model = AutoModelForCausalLM.from_config(hf_config(**overrides), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            values = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * values)
            elif name.endswith("router.weight"):
                param.copy_(values)
            else:
                param.copy_(values * 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)


def build_multimodal_checkpoint(text_dir: Path | str, out_dir: Path | str) -> None:
    """The text model's tensors as Llama4ForConditionalGeneration saves them (`language_model.` before each), beside
    a vision model (tests/llama4_vision_models.py's shape) and projector of random values, and a `llama4` config
    around the text config."""
    from safetensors.torch import load_file, save_file
    from transformers import Llama4VisionConfig, Llama4VisionModel

    from tests.llama4_vision_models import VISION

    text_dir, out_dir = Path(text_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"language_model.{key}": t for key, t in load_file(text_dir / "model.safetensors").items()}
    vision = Llama4VisionModel(Llama4VisionConfig(**VISION))
    tensors.update({f"vision_model.{key}": t.detach().clone() for key, t in vision.state_dict().items()})
    text = json.loads((text_dir / "config.json").read_text())
    tensors["multi_modal_projector.linear_1.weight"] = torch.randn(text["hidden_size"], VISION["vision_output_dim"])
    save_file(tensors, out_dir / "model.safetensors")
    config = {
        "model_type": "llama4",
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": text,
        "vision_config": VISION,
        "tie_word_embeddings": False,
    }
    (out_dir / "config.json").write_text(json.dumps(config))


def build_llama4_adapter(
    model_dir: Path | str,
    out_dir: Path | str,
    *,
    r: int,
    lora_alpha: float,
    target_modules: tuple[str, ...],
    experts: bool,
    seed: int,
    **patterns,
) -> None:
    """Built by peft itself: `target_modules` (gate/up/down reach the dense layers' MLP and the MoE layers' shared
    expert), and with `experts` the stacked experts by `target_parameters`; every A and B random."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.lora_helpers import randomize_adapter

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        target_parameters=EXPERT_PARAMETERS if experts else None,
        lora_dropout=0.0,
        **patterns,
    )
    peft_model = get_peft_model(model, config)
    randomize_adapter(peft_model, seed)
    peft_model.save_pretrained(out_dir)


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def build_llama4_set(root: Path, with_tokenizer: bool = False) -> tuple[Path, dict[str, Path]]:
    """A model and two adapters: "a4" on attention only, "a8" on attention, the MLPs (the dense layers' and the
    shared experts') and the stacked experts, whose gate_up has its own rank and alpha (patterns)."""
    model_dir = root / "llama4"
    build_llama4_model(model_dir, with_tokenizer=with_tokenizer)
    adapters = {"a4": root / "llama4-a4", "a8": root / "llama4-a8"}
    build_llama4_adapter(model_dir, adapters["a4"], r=4, lora_alpha=8, target_modules=ATTENTION, experts=False, seed=1)
    build_llama4_adapter(
        model_dir,
        adapters["a8"],
        r=8,
        lora_alpha=16,
        experts=True,
        seed=2,
        target_modules=(*ATTENTION, "gate_proj", "up_proj", "down_proj"),
        rank_pattern={r".*\.gate_up_proj": 4},
        alpha_pattern={r".*\.gate_up_proj": 12},
    )
    return model_dir, adapters
