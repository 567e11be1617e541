"""Mistral with a sliding window serves prompts longer than the window, equal to HF transformers (fp32), on the torch
and triton attention backends; the window is no longer a context cap."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from loraplex.kernels import cpu_ext
from loraplex.protocol.structs import ForwardReq
from loraplex.worker.model.config import ModelConfig
from transformers import AutoModelForCausalLM, MistralConfig

from tests.reference import assert_greedy_match, hf_greedy
from tests.worker_helpers import (
    GREEDY,
    PAGE_SIZE,
    TINY_LLAMA,
    Seq,
    make_runner,
    prefill_logits,
    random_prompts,
    run_greedy_schedule,
)

WINDOW = 6


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mistral_window")
    model = AutoModelForCausalLM.from_config(MistralConfig(**TINY_LLAMA, sliding_window=WINDOW), dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            values = torch.randn(param.shape, generator=generator) * 0.3
            param.copy_(torch.ones_like(param) if name.endswith("norm.weight") else values)
    model.save_pretrained(path, safe_serialization=True)
    return path


def test_every_layer_is_windowed_and_the_context_is_not_capped(mistral_dir: Path) -> None:
    config = ModelConfig.from_dir(str(mistral_dir))
    assert config.layer_windows == (WINDOW, WINDOW) and config.max_context_length == 512


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_mistral_past_its_window_matches_hf(mistral_dir: Path, attention: str) -> None:
    runner = make_runner(mistral_dir, attention_backend=attention)
    hf = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()
    prompts = random_prompts([3 * WINDOW, 5, 3 * WINDOW + 7], runner.vocab_size, seed=3)
    for prompt in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert (prefill_logits(runner, prompt) - ref).abs().max().item() <= 1e-4, len(prompt)
    steps = 2 * WINDOW
    seqs = [Seq(prompt=p, prefill_chunk=4 if i == 2 else len(p)) for i, p in enumerate(prompts)]
    ours = run_greedy_schedule(runner, seqs, start_steps=[0, 0, 1], max_new_tokens=steps)
    compared = 0
    for prompt, out in zip(prompts, ours, strict=True):
        ref, margins = hf_greedy(mistral_dir, prompt, steps)
        compared += assert_greedy_match(out, ref, margins, what=f"{len(prompt)} tokens")
    assert compared >= steps * len(prompts) // 2


@pytest.mark.skipif(cpu_ext.unavailable_reason() is not None, reason="the CPU kernels cannot run here")
def test_cpu_decode_kernel_keeps_to_the_window(tmp_path: Path) -> None:
    # bfloat16, head_dim 64: decodes go to cpu_ext's decode_attention, which must read only the window's keys, as
    # the torch backend's masked SDPA does.
    config = MistralConfig(**{**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 384}, sliding_window=WINDOW)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path, safe_serialization=True)
    prompts = random_prompts([4 * WINDOW, 3, 2 * WINDOW + 1], 256, seed=8)

    def decode_logits(attention: str, window: int | None) -> torch.Tensor:
        runner = make_runner(tmp_path, dtype="bfloat16", attention_backend=attention)
        assert runner.attention.name == attention
        for layer in runner.model.model.layers:
            layer.self_attn.layer = dataclasses.replace(layer.self_attn.layer, sliding_window=window)
        pages = [list(range(i * 16, i * 16 + -(-(len(p) + 1) // PAGE_SIZE))) for i, p in enumerate(prompts)]
        prefill = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY)
                   for p, pg in zip(prompts, pages, strict=True)]  # fmt: skip
        with torch.inference_mode():
            runner.logits(prefill, [], last_only=True)
            step = [ForwardReq(input_ids=[5], num_cached_tokens=len(p), page_ids=pg, sampling=GREEDY)
                    for p, pg in zip(prompts, pages, strict=True)]  # fmt: skip
            return runner.logits(step, [], last_only=True)

    kernel, sdpa = decode_logits("cpu", WINDOW), decode_logits("torch", WINDOW)
    assert (kernel - sdpa).abs().max() <= 0.05 * sdpa.abs().max()
    assert (decode_logits("torch", None) - sdpa).abs().max() > 0.2 * sdpa.abs().max()  # the window matters
