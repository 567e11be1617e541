"""Qwen3 with LoRA in the worker against HF transformers + peft in fp32: the base model and two adapters in one batch
(logits and greedy tokens), and a prompt prefilled in chunks over pages another request's prefix filled."""

from __future__ import annotations

from pathlib import Path

import pytest
from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq, SlotLoad
from loraplex.worker.lora.layers import LoRALinear
from loraplex.worker.model.qwen3 import Qwen3Attention
from loraplex.worker.model_runner import ModelRunner

from tests.reference import (
    assert_greedy_matches_peft,
    assert_logits_match_peft,
    hf_logits,
)
from tests.worker_helpers import (
    GREEDY,
    chunked_prefill_after_a_prefix,
    consecutive_pages,
    decode,
    forward_logits,
    make_runner,
    random_prompts,
)

FP32_TOL = 1e-4
DECODE_STEPS = 6
MIN_ADAPTER_EFFECT = 0.1
SLOTS = {"q8": 0, "q16": 1}
LORA_IDS = {"q8": 1, "q16": 2}
# Base rows between adapters, q8 twice in a row.
MIXED = [None, "q8", "q8", "q16", None, "q16", "q8"]
LENGTHS = [5, 9, 3, 12, 7, 4, 10]


@pytest.fixture(scope="module")
def runner(qwen3_dir: Path, qwen3_adapter_dirs: dict[str, Path]) -> ModelRunner:
    runner = make_runner(qwen3_dir, enable_lora=True, max_lora_rank=16, lora_target_modules=["all"],
                         max_loras_per_batch=2)  # fmt: skip
    specs = [AdapterToLoad(lora_name=n, lora_path=str(p), lora_id=LORA_IDS[n]) for n, p in qwen3_adapter_dirs.items()]
    assert all(r.success for r in runner.lora.load(specs))
    return runner


def slot_of(name: str | None) -> int:
    return -1 if name is None else SLOTS[name]


SLOT_LOADS = [SlotLoad(slot=SLOTS[name], lora_id=LORA_IDS[name]) for name in SLOTS]


def test_model_is_qwen3_with_lora_on_every_projection(runner: ModelRunner) -> None:
    layer = runner.model.model.layers[0]
    assert isinstance(layer.self_attn, Qwen3Attention)
    assert layer.self_attn.qkv_proj.base.bias is None  # no qkv bias in Qwen3
    assert all(isinstance(m, LoRALinear) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj))  # fmt: skip
    # The builder's norm weights are not all ones, so a q/k norm loaded wrong (or skipped) fails the comparisons.
    assert layer.self_attn.q_norm.weight.std().item() > 0.05


def test_mixed_batch_matches_peft(runner: ModelRunner, qwen3_dir: Path, qwen3_adapter_dirs: dict[str, Path]) -> None:
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=41)
    pages = consecutive_pages(LENGTHS, runner.page_size)
    reqs = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=slot_of(n))
            for p, pg, n in zip(prompts, pages, MIXED, strict=True)]  # fmt: skip
    logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=SLOT_LOADS))
    ours = logits.split(LENGTHS)
    assert_logits_match_peft(ours, prompts, MIXED, qwen3_dir, qwen3_adapter_dirs, FP32_TOL, MIN_ADAPTER_EFFECT)

    slots = [slot_of(n) for n in MIXED]
    outputs = decode(runner, prompts, [GREEDY] * len(prompts), DECODE_STEPS, slots=slots, slot_loads=SLOT_LOADS)
    assert_greedy_matches_peft(outputs, prompts, MIXED, qwen3_dir, qwen3_adapter_dirs, DECODE_STEPS)


def test_chunked_prefill_over_a_shared_prefix_matches_peft(
    runner: ModelRunner, qwen3_dir: Path, qwen3_adapter_dirs: dict[str, Path]
) -> None:
    prompt, num_cached, ours = chunked_prefill_after_a_prefix(runner, slot_of("q16"), SLOT_LOADS)
    ref = hf_logits(qwen3_dir, prompt, qwen3_adapter_dirs["q16"])[num_cached:]
    diff = (ours - ref).abs().max().item()
    assert diff <= FP32_TOL, f"max abs logit diff {diff:.2e}"
