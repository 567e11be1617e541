"""Tiny random Gemma 4 text checkpoints built with transformers' Gemma4TextConfig, a multimodal checkpoint around one,
and PEFT adapters on them (no tests here)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

WINDOW = 8  # the sliding layers' window: prompts past it reach beyond
# Dense: sliding, full, sliding, then two KV-shared layers (3 reads layer 2's cache, 4 reads layer 1's) with MLPs
# twice as wide; full layers with heads of 24 (its keys narrower than a sliding layer's: a strided view of the cache)
# and 2 KV heads whose values are the keys' projection; per-layer inputs of 8; final logit soft-capping.
DENSE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    global_head_dim=24,
    num_global_key_value_heads=2,
    attention_k_eq_v=True,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    sliding_window=WINDOW,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=256,
    final_logit_softcapping=10.0,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# MoE: every layer's dense MLP beside 4 experts (top 2); values projected on every layer; no per-layer inputs.
MOE = dict(
    DENSE,
    num_hidden_layers=3,
    layer_types=["sliding_attention", "full_attention", "full_attention"],
    num_key_value_heads=2,
    attention_k_eq_v=False,
    num_global_key_value_heads=None,
    num_kv_shared_layers=0,
    use_double_wide_mlp=False,
    hidden_size_per_layer_input=0,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
)
CONFIGS = {"dense": DENSE, "moe": MOE}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


def hf_config(kind: str, **overrides):
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(**{**CONFIGS[kind], **overrides})


def build_gemma4_model(out_dir: Path | str, kind: str, seed: int = 0, with_tokenizer: bool = False,
                       **overrides) -> None:  # fmt: skip
    """Random weights: norms, router scales and layer scalars near 1, the router of std 1 (its experts clearly
    apart), the rest of std 0.3; with_tokenizer: the tests' tiny tokenizer beside it (and its vocabulary)."""
    from transformers import AutoModelForCausalLM

    from tests.builders import build_tokenizer, tokenizer_vocab_size

    if with_tokenizer:
        vocab = tokenizer_vocab_size()
        overrides = dict(vocab_size=vocab, vocab_size_per_layer_input=vocab, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, **overrides)  # fmt: skip
        build_tokenizer(out_dir)
    model = AutoModelForCausalLM.from_config(hf_config(kind, **overrides), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    near_one = ("norm.weight", "router.scale", "per_expert_scale", "layer_scalar")
    with torch.no_grad():
        for name, param in sorted([*model.named_parameters(), *model.named_buffers()]):
            if not param.is_floating_point() or "inv_freq" in name or name.endswith("embed_scale"):
                continue
            values = torch.randn(param.shape, generator=generator)
            if name.endswith(near_one):
                param.copy_(1.0 + 0.1 * values)
            elif name.endswith("router.proj.weight"):
                param.copy_(values)
            else:
                param.copy_(values * 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)


def build_multimodal_checkpoint(text_dir: Path | str, out_dir: Path | str) -> None:
    """The text model's tensors as Gemma4ForConditionalGeneration saves them (`model.language_model.`), beside a tiny
    vision tower and embedder (tests/gemma4_vision_models.py's, random: loaded, and unused by a text prompt) and audio
    ones of random values (skipped), and a `gemma4` config around the text config."""
    from safetensors.torch import load_file, save_file
    from transformers import Gemma4VisionConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder, Gemma4VisionModel

    from tests.gemma4_vision_models import VISION

    text_dir, out_dir = Path(text_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.language_model.{key.removeprefix('model.')}": t
               for key, t in load_file(text_dir / "model.safetensors").items()}  # fmt: skip
    text = json.loads((text_dir / "config.json").read_text())
    vision = Gemma4VisionConfig(**VISION)
    tensors.update({f"model.vision_tower.{key}": t for key, t in Gemma4VisionModel(vision).state_dict().items()})
    embedder = Gemma4MultimodalEmbedder(vision, hf_config("dense", hidden_size=text["hidden_size"]))
    tensors.update({f"model.embed_vision.{key}": t for key, t in embedder.state_dict().items()})
    for name in ("audio_tower.output_proj.weight", "embed_audio.projection.weight"):
        tensors[f"model.{name}"] = torch.randn(8, 12)
    save_file({key: t.contiguous() for key, t in tensors.items()}, out_dir / "model.safetensors")
    config = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text,
              "vision_config": VISION, "tie_word_embeddings": True}  # fmt: skip
    (out_dir / "config.json").write_text(json.dumps(config))


def build_gemma4_adapter(model_dir: Path | str, out_dir: Path | str, *, r: int, lora_alpha: float,
                         target_modules: tuple[str, ...], experts: bool, seed: int) -> None:  # fmt: skip
    """Built by peft itself: `target_modules` (gate/up/down reach each layer's dense MLP), with `experts` the stacked
    experts by `target_parameters`; every A and B random."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.lora_helpers import randomize_adapter

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        target_parameters=EXPERT_PARAMETERS if experts else None)  # fmt: skip
    peft_model = get_peft_model(model, config)
    randomize_adapter(peft_model, seed)
    peft_model.save_pretrained(out_dir)


def build_gemma4_set(root: Path, kind: str, with_tokenizer: bool = False) -> tuple[Path, dict[str, Path]]:
    """A model and two adapters: "a4" on attention alone, "a8" on attention, the dense MLPs and (MoE) every
    expert."""
    model_dir = root / f"gemma4_{kind}"
    build_gemma4_model(model_dir, kind, with_tokenizer=with_tokenizer)
    adapters = {"a4": root / f"gemma4_{kind}-a4", "a8": root / f"gemma4_{kind}-a8"}
    build_gemma4_adapter(model_dir, adapters["a4"], r=4, lora_alpha=8, target_modules=ATTENTION, experts=False,
                         seed=1)  # fmt: skip
    build_gemma4_adapter(model_dir, adapters["a8"], r=8, lora_alpha=16, target_modules=(*ATTENTION, *MLP),
                         experts=kind == "moe", seed=2)  # fmt: skip
    return model_dir, adapters
