"""Phi-3 / Phi-4-mini in the worker against HF transformers + peft: checkpoints with fused qkv_proj / gate_up_proj,
partial rotary with longrope, and PEFT adapters on the fused modules mixed with the base model in one batch, with the
prefix cache's cached tokens and chunked prefill."""

from __future__ import annotations

import json

import pytest
import torch
from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq, SlotLoad
from loraplex.worker.model.phi3 import Phi3ForCausalLM
from loraplex.worker.model_runner import ModelRunner
from safetensors import safe_open

from tests.lora_helpers import build_peft_adapter
from tests.phi3_helpers import PHI3_TARGETS, PHI4_MINI_LIKE, build_tiny_phi3
from tests.reference import assert_greedy_match, hf_greedy, hf_model
from tests.worker_helpers import GREEDY, PAGE_SIZE, consecutive_pages, forward_logits, make_runner, random_prompts

FP32_TOL = 1e-4
LORA = dict(enable_lora=True, max_lora_rank=16, lora_target_modules=["all"], max_loras_per_batch=2)
ADAPTERS = {  # name -> (lora_id, slot, r, alpha, targets)
    "fused": (1, 0, 8, 16.0, PHI3_TARGETS),
    "attn": (2, 1, 16, 8.0, ("qkv_proj", "o_proj")),
}
MIXED = [None, "fused", "attn", "fused", None, "attn"]
LENGTHS = [5, 9, 12, 3, 7, 10]
DECODE_STEPS = 8


@pytest.fixture(scope="module", params=["phi3", "phi4_mini_like"])
def phi3_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp(request.param)
    base = root / "base"
    build_tiny_phi3(base, **(PHI4_MINI_LIKE if request.param == "phi4_mini_like" else {}))
    adapters = {}
    for seed, (name, (_, _, r, alpha, targets)) in enumerate(ADAPTERS.items(), start=1):
        adapters[name] = root / name
        build_peft_adapter(base, adapters[name], r=r, lora_alpha=alpha, target_modules=targets, seed=seed)
    runner = make_runner(base, **LORA)
    results = runner.lora.load(
        [AdapterToLoad(lora_name=n, lora_path=str(p), lora_id=ADAPTERS[n][0]) for n, p in adapters.items()]
    )
    assert all(r.success for r in results), [r.error_message for r in results]
    return dict(kind=request.param, base=base, adapters=adapters, runner=runner)


def _adapter_dir(case: dict, name: str | None) -> str | None:
    return None if name is None else str(case["adapters"][name])


def _slot_loads() -> list[SlotLoad]:
    return [SlotLoad(slot=slot, lora_id=lora_id) for lora_id, slot, *_ in ADAPTERS.values()]


def _slot(name: str | None) -> int:
    return -1 if name is None else ADAPTERS[name][1]


def test_checkpoint_is_fused_and_read_as_phi3(phi3_case: dict) -> None:
    with safe_open(phi3_case["base"] / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)
    runner: ModelRunner = phi3_case["runner"]
    assert type(runner.model) is Phi3ForCausalLM
    rope = runner.model_config.rope
    if phi3_case["kind"] == "phi4_mini_like":
        assert rope.rope_type == "longrope" and rope.rotary_dim(runner.model_config.head_dim) == 12
        assert json.loads((phi3_case["base"] / "config.json").read_text())["tie_word_embeddings"]
    adapter_config = json.loads((phi3_case["adapters"]["fused"] / "adapter_config.json").read_text())
    assert set(adapter_config["target_modules"]) == set(PHI3_TARGETS)  # as PEFT wrote it


@torch.inference_mode()
def test_mixed_batch_logits_match_peft(phi3_case: dict) -> None:
    runner: ModelRunner = phi3_case["runner"]
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=5)
    pages = consecutive_pages(LENGTHS, PAGE_SIZE)
    reqs = [
        ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=_slot(n))
        for p, pg, n in zip(prompts, pages, MIXED, strict=True)
    ]
    logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=_slot_loads()))
    for prompt, name, ours in zip(prompts, MIXED, logits.split(LENGTHS), strict=True):
        ref = hf_model(str(phi3_case["base"]), _adapter_dir(phi3_case, name))(torch.tensor([prompt])).logits[0]
        assert (ours - ref).abs().max().item() <= FP32_TOL, name
        if name is not None:
            base = hf_model(str(phi3_case["base"]))(torch.tensor([prompt])).logits[0]
            assert (ref - base).abs().max().item() > 0.1, f"{name} barely changes the logits"


def test_greedy_with_prefix_cache_and_chunked_prefill_matches_peft(phi3_case: dict) -> None:
    """Each request prefills in chunks of 4 beside the others' decode steps, starting after a cached prefix that a
    first pass over the same pages wrote (as a prefix-cache hit reuses a page)."""
    runner: ModelRunner = phi3_case["runner"]
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=9)
    page_ids = [list(range(20 * i, 20 * i + 20)) for i in range(len(prompts))]
    cached = [len(p) // 2 for p in prompts]
    first = [
        ForwardReq(input_ids=p[:c], num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=_slot(n))
        for p, c, pg, n in zip(prompts, cached, page_ids, MIXED, strict=True)
        if c
    ]
    runner.forward(ForwardBatch(batch_id=0, reqs=first, slot_loads=_slot_loads()))
    num_cached = list(cached)
    outputs: list[list[int]] = [[] for _ in prompts]
    step = 1
    while any(len(o) < DECODE_STEPS for o in outputs):
        active = [i for i, o in enumerate(outputs) if len(o) < DECODE_STEPS]
        reqs = []
        for i in active:
            prompt = prompts[i]
            input_ids = prompt[num_cached[i] : num_cached[i] + 4] if num_cached[i] < len(prompt) else outputs[i][-1:]
            reqs.append(ForwardReq(input_ids=input_ids, num_cached_tokens=num_cached[i], page_ids=page_ids[i],
                                   sampling=GREEDY, slot=_slot(MIXED[i])))  # fmt: skip
        tokens = runner.forward(ForwardBatch(batch_id=step, reqs=reqs))
        for i, req, token in zip(active, reqs, tokens, strict=True):
            num_cached[i] += len(req.input_ids)
            if num_cached[i] >= len(prompts[i]):
                outputs[i].append(token)
        step += 1
    num_compared = 0
    for prompt, name, out in zip(prompts, MIXED, outputs, strict=True):
        ref, margins = hf_greedy(phi3_case["base"], prompt, DECODE_STEPS, _adapter_dir(phi3_case, name))
        num_compared += assert_greedy_match(out, ref, margins, what=name or "base")
    assert num_compared >= DECODE_STEPS * len(prompts) // 2


@pytest.mark.parametrize("phi3_case", ["phi4_mini_like"], indirect=True)  # the model with longrope
@torch.inference_mode()
def test_long_rope_requests_match_transformers_past_the_original_length(phi3_case: dict) -> None:
    """A sequence longer than the original 64 positions takes the long factors at every position in transformers
    (and in a long_rope request, as the scheduler marks it): prefill logits and greedy decoding, with adapters."""
    runner: ModelRunner = phi3_case["runner"]
    assert runner.long_rope_len == 64
    prompts = random_prompts([70, 90], runner.vocab_size, seed=13)
    names = [None, "fused"]
    reqs = [
        ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=list(range(30 * i, 30 * i + 25)), sampling=GREEDY,
                   slot=_slot(n), long_rope=True)  # fmt: skip
        for i, (p, n) in enumerate(zip(prompts, names, strict=True))
    ]
    logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=_slot_loads()))
    for prompt, name, ours in zip(prompts, names, logits.split([70, 90]), strict=True):
        ref = hf_model(str(phi3_case["base"]), _adapter_dir(phi3_case, name))(torch.tensor([prompt])).logits[0]
        assert (ours - ref).abs().max().item() <= FP32_TOL, name
    short = [ForwardReq(input_ids=prompts[0], num_cached_tokens=0, page_ids=list(range(25)), sampling=GREEDY)]
    short_logits = forward_logits(runner, ForwardBatch(batch_id=1, reqs=short))
    assert (short_logits - logits[:70]).abs().max().item() > 0.1  # the short factors would differ here
