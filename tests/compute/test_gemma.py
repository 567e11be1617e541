"""Gemma 2 and Gemma 3 text models in the worker against HF transformers (+ peft), fp32: prefill logits on every
attention backend, paged greedy decoding with chunked prefill and a prefix-cache hit, prompts of 3x the sliding
window, and the base model with two adapters in one batch."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from loraplex.protocol.structs import SlotLoad
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model_runner import ModelRunner
from transformers import AutoModelForCausalLM

from tests.builders import build_lora_adapter
from tests.gemma_helpers import LAYER_TYPES, WINDOW, build_tiny_gemma
from tests.reference import assert_greedy_match, hf_greedy, hf_model
from tests.worker_helpers import Seq, make_runner, prefill_logits, random_prompts, run_greedy_schedule

FAMILIES = ("gemma2", "gemma3_text")
FP32_TOL = 1e-4
LONG = 3 * WINDOW + 5  # a prompt well past the window
LORA_CONFIG = dict(enable_lora=True, max_lora_rank=16, lora_target_modules=["all"], max_loras_per_batch=2)
ADAPTERS = {"all16": (16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
            "attn8": (8, ("q_proj", "v_proj", "o_proj"))}  # fmt: skip


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for family in FAMILIES:
        dirs[family] = tmp_path_factory.mktemp(family)
        build_tiny_gemma(dirs[family], family)
    return dirs


@pytest.fixture(scope="module")
def gemma_adapters(tmp_path_factory: pytest.TempPathFactory, gemma_dirs: dict[str, Path]) -> dict[str, dict]:
    out: dict[str, dict[str, Path]] = {}
    for family, base in gemma_dirs.items():
        out[family] = {}
        for seed, (name, (r, targets)) in enumerate(ADAPTERS.items(), start=1):
            out[family][name] = tmp_path_factory.mktemp(f"{family}_{name}")
            build_lora_adapter(base, out[family][name], r=r, lora_alpha=2 * r, target_modules=targets, seed=seed)
    return out


def hf_logits(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]  # (len, vocab)


def test_config_reads_the_gemma_fields(gemma_dirs: dict[str, Path]) -> None:
    gemma2 = ModelConfig.from_dir(str(gemma_dirs["gemma2"]))
    windows = tuple(WINDOW if kind == "sliding_attention" else None for kind in LAYER_TYPES)
    assert gemma2.layer_windows == windows and gemma2.attention_scale == 24**-0.5
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.local_rope) == (2.0, 8.0, None)
    gemma3 = ModelConfig.from_dir(str(gemma_dirs["gemma3_text"]))
    assert gemma3.layer_windows == windows and gemma3.attn_logit_softcap is None
    assert gemma3.rope.theta == 1e6 and gemma3.rope.rope_type == "linear" and gemma3.local_rope.theta == 1e4
    assert gemma3.max_context_length == 512  # the window no longer caps the context


# The triton backend runs in Triton's interpreter here; the cpu backend needs bfloat16 (test_cpu_kernels_worker.py).
@pytest.mark.parametrize("attention", ["torch", "triton"])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_hf(gemma_dirs: dict[str, Path], family: str, attention: str) -> None:
    runner = make_runner(gemma_dirs[family], attention_backend=attention)
    for prompt in random_prompts([1, 7, LONG], runner.vocab_size, seed=1):
        diff = (prefill_logits(runner, prompt) - hf_logits(gemma_dirs[family], prompt)).abs().max().item()
        assert diff <= FP32_TOL, f"{family} on {attention}, {len(prompt)} tokens: {diff:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_window_and_caps_matter(gemma_dirs: dict[str, Path], family: str) -> None:
    # Without its sliding windows (and soft-caps) the model's logits past the window differ: the tests above would
    # see a model that ignored them.
    runner = make_runner(gemma_dirs[family])
    [prompt] = random_prompts([LONG], runner.vocab_size, seed=1)
    reference = prefill_logits(runner, prompt)[-1]
    for layer in runner.model.model.layers:
        layer.self_attn.layer = dataclasses.replace(layer.self_attn.layer, sliding_window=None)
    assert (prefill_logits(runner, prompt)[-1] - reference).abs().max() > 0.05
    if family == "gemma2":
        for layer in runner.model.model.layers:
            layer.self_attn.layer = dataclasses.replace(layer.self_attn.layer, logit_cap=None)
        uncapped = prefill_logits(runner, prompt)[-1]
        runner.model.config = dataclasses.replace(runner.model.config, final_logit_softcap=None)
        assert (prefill_logits(runner, prompt)[-1] - uncapped).abs().max() > 0.05


def greedy_schedule(runner: ModelRunner, prompts: list[list[int]], slots: list[int], steps: int,
                    slot_loads: list[SlotLoad] = ()) -> list[list[int]]:  # fmt: skip
    """Prompts 0-1 prefill whole, prompt 2 in chunks of 5 while the others decode, prompt 3 joins at step 2."""
    seqs = [Seq(prompt=p, prefill_chunk=5 if i == 2 else len(p), slot=slot)
            for i, (p, slot) in enumerate(zip(prompts, slots, strict=True))]  # fmt: skip
    return run_greedy_schedule(runner, seqs, start_steps=[0, 0, 0, 2], max_new_tokens=steps,
                               slot_loads=list(slot_loads))  # fmt: skip


@pytest.mark.parametrize("attention", ["torch", "triton"])
@pytest.mark.parametrize("family", FAMILIES)
def test_paged_greedy_with_chunked_prefill_matches_hf(gemma_dirs: dict[str, Path], family: str,
                                                      attention: str) -> None:  # fmt: skip
    runner = make_runner(gemma_dirs[family], attention_backend=attention)
    prompts = random_prompts([LONG, 5, LONG + 3, 2 * WINDOW], runner.vocab_size, seed=2)
    steps = WINDOW + 2  # decoding carries each prompt further past the window
    ours = greedy_schedule(runner, prompts, [-1] * 4, steps)
    compared = 0
    for prompt, out in zip(prompts, ours, strict=True):
        ref, margins = hf_greedy(gemma_dirs[family], prompt, steps)
        compared += assert_greedy_match(out, ref, margins, what=f"{family} {len(prompt)} tokens")
    assert compared >= steps * len(prompts) // 2


def test_prefix_cache_hit_matches_hf(gemma_dirs: dict[str, Path]) -> None:
    # A second request reuses the first's cached pages for its first 2 windows of tokens (a prefix-cache hit).
    model_dir = gemma_dirs["gemma3_text"]
    runner = make_runner(model_dir)
    first, tail = random_prompts([LONG, 9], runner.vocab_size, seed=5)
    owner = Seq(prompt=first, prefill_chunk=len(first))
    run_greedy_schedule(runner, [owner], [0], max_new_tokens=1)
    shared = 2 * WINDOW  # whole pages (4 tokens each)
    hit = Seq(prompt=first[:shared] + tail, prefill_chunk=len(tail), page_ids=owner.page_ids[: shared // 4],
              num_cached=shared)  # fmt: skip
    [out] = run_greedy_schedule(runner, [hit], [0], max_new_tokens=6)
    ref, margins = hf_greedy(model_dir, hit.prompt, 6)
    assert assert_greedy_match(out, ref, margins, what="prefix hit") >= 3


@pytest.mark.parametrize("family", FAMILIES)
def test_base_and_two_adapters_in_one_batch_match_peft(gemma_dirs: dict[str, Path], gemma_adapters: dict[str, dict],
                                                       family: str) -> None:  # fmt: skip
    from loraplex.protocol.structs import AdapterToLoad

    runner = make_runner(gemma_dirs[family], **LORA_CONFIG)
    adapters = gemma_adapters[family]
    specs = [AdapterToLoad(lora_name=name, lora_path=str(adapters[name]), lora_id=i + 1)
             for i, name in enumerate(ADAPTERS)]  # fmt: skip
    assert all(r.success for r in runner.lora.load(specs))
    loads = [SlotLoad(slot=0, lora_id=1), SlotLoad(slot=1, lora_id=2)]
    names = [None, "all16", "attn8", "all16"]
    slots = [-1, 0, 1, 0]
    prompts = random_prompts([LONG, 11, LONG + 2, 2 * WINDOW], runner.vocab_size, seed=7)
    steps = 6
    ours = greedy_schedule(runner, prompts, slots, steps, loads)
    compared = 0
    for prompt, name, out in zip(prompts, names, ours, strict=True):
        ref, margins = hf_greedy(gemma_dirs[family], prompt, steps, None if name is None else adapters[name])
        compared += assert_greedy_match(out, ref, margins, what=f"{family} {name or 'base'}")
        if name is not None:  # the adapter moves the logits: a LoRA that did nothing would pass the line above
            with torch.no_grad():
                base, tuned = (hf_model(str(gemma_dirs[family]), adapter)(torch.tensor([prompt])).logits[0, -1]
                               for adapter in (None, str(adapters[name])))  # fmt: skip
            assert (tuned - base).abs().max() > 0.1, name
    assert compared >= steps * len(prompts) // 2


def test_multimodal_gemma3_checkpoint_serves_its_language_model(gemma_dirs: dict[str, Path], tmp_path: Path) -> None:
    # A `gemma3` checkpoint as transformers 4 saves it: the text model under language_model.*, a (tiny) vision tower
    # and projector beside; a text prompt's logits are the text model's.
    import json

    from safetensors.torch import load_file, save_file
    from transformers import SiglipVisionConfig, SiglipVisionModel

    text_dir = gemma_dirs["gemma3_text"]
    tensors = {f"language_model.{name}": t for name, t in load_file(text_dir / "model.safetensors").items()}
    vision = dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                  patch_size=4, vision_use_head=False)  # fmt: skip
    tower = SiglipVisionModel(SiglipVisionConfig(**vision)).state_dict()
    tensors.update({f"vision_tower.vision_model.{name}": t.contiguous() for name, t in tower.items()})
    text_config = json.loads((text_dir / "config.json").read_text())
    tensors["multi_modal_projector.mm_input_projection_weight"] = torch.zeros(8, text_config["hidden_size"])
    tensors["multi_modal_projector.mm_soft_emb_norm.weight"] = torch.zeros(8)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = {"model_type": "gemma3", "text_config": text_config, "vision_config": vision, "mm_tokens_per_image": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    [prompt] = random_prompts([LONG], 256, seed=9)
    ours = prefill_logits(make_runner(tmp_path), prompt)
    assert torch.equal(ours, prefill_logits(make_runner(text_dir), prompt))
