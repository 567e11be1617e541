"""Speculative decoding in process: the real scheduler and a real worker (ModelRunner) in one loop. With a draft model
(DraftRunner, its KV on the target's pages), greedy outputs equal those without speculation, through prefill chunks,
prefix hits and many concurrent requests; a draft that is the target itself has every draft accepted. Draft adapters
(--speculative-lora-modules): in a batch of the base and two adapters, the adapter with a draft counterpart (the target
adapter itself, on a draft that is the target) has every draft accepted, where without it fewer are; outputs equal the
run without speculation. An EAGLE-3 head (random weights) leaves the same batch's greedy outputs as they are."""

from __future__ import annotations

import pytest
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import (
    AdapterReport,
    BatchResult,
    LoadAdapters,
    SamplingParams,
    TokenizedGenerateReq,
)
from loraplex.scheduler.scheduler import Scheduler
from loraplex.worker.model_runner import ModelRunner

from tests.builders import build_eagle3_head, build_tiny_model
from tests.lora_helpers import ADAPTER_IDS, LORA_CONFIG, specs
from tests.worker_helpers import NUM_PAGES, PAGE_SIZE, random_prompts

MAX_NEW = 12


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller model with the target's tokenizer (one layer, another seed): it agrees with the target sometimes."""
    path = tmp_path_factory.mktemp("draft")
    build_tiny_model(path, num_layers=1, seed=5)
    return path


def generate(model_dir, prompts: list[list[int]], speculative_config: dict | None = None, *,
             adapters: dict | None = None, names: list[str | None] | None = None,
             **config_kwargs) -> tuple[dict, Scheduler]:  # fmt: skip
    """Every prompt's greedy tokens through Scheduler + ModelRunner in one loop (prefill chunks of 8 tokens), prompt i
    on adapter names[i] of `adapters` (name -> directory, loaded on both first)."""
    lora = LORA_CONFIG if adapters else {}
    config = ServerConfig(device="cpu", page_size=PAGE_SIZE, max_total_tokens=NUM_PAGES * PAGE_SIZE,
                          speculative_config=speculative_config or {}, **lora, **config_kwargs)  # fmt: skip
    runner = ModelRunner(config, str(model_dir), rank=0, world_size=1, device="cpu")
    sched = Scheduler(config, num_pages=NUM_PAGES, context_length=256, chunked_prefill_size=8)
    if adapters:
        op = LoadAdapters(op_id=1, adapters=specs(adapters, {name: ADAPTER_IDS[name] for name in adapters}))
        assert sched.load_adapters(op, now=0.0) == op
        outcomes = runner.lora.load(op.adapters)
        assert all(o.success for o in outcomes), outcomes
        assert sched.add_adapter_report(AdapterReport(op_id=1, tp_rank=0, outcomes=outcomes)) is not None
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
        lora_id = None if names is None or names[i] is None else ADAPTER_IDS[names[i]]
        req = TokenizedGenerateReq(rid=f"r{i}", input_ids=prompt, sampling=sampling, lora_id=lora_id)
        assert sched.add_request(req) == []
    for _ in range(500):
        batch = sched.schedule()
        if batch is None:
            break
        step = runner.step(batch)
        result = BatchResult(batch_id=batch.batch_id, next_token_ids=step.tokens, accepted_ids=step.accepted_ids)
        for delta in sched.process_result(result):
            assert delta.finish_reason in (None, "length"), delta
            outputs.setdefault(delta.rid, []).extend(delta.token_ids)
    assert sched.is_idle and sched.cache.num_in_use == 0
    return outputs, sched


def test_greedy_with_a_draft_model_equals_greedy_without(llama_dir, draft_dir):
    prompts = random_prompts([5, 19, 9, 19], vocab_size=200, seed=3)
    prompts[3] = prompts[1][:16] + prompts[3][16:]  # a prefix hit on the second's pages
    reference, _ = generate(llama_dir, prompts)
    draft_model = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(draft_dir)}
    outputs, sched = generate(llama_dir, prompts, draft_model)
    assert outputs == reference
    [count] = sched.stats(op_id=0).spec
    assert count.num_verify_passes > 0 and count.num_draft_tokens > 0
    itself = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(llama_dir)}
    outputs, sched = generate(llama_dir, prompts, itself)
    assert outputs == reference
    [count] = sched.stats(op_id=0).spec
    assert count.num_accepted_tokens == count.num_draft_tokens > 0  # the target drafting for itself: all accepted


MIXED_NAMES = [None, "a4", "a8", "a8", "a4", None]


@pytest.fixture(scope="module")
def mixed(llama_dir, adapter_dirs) -> tuple[list[list[int]], dict, dict]:
    """(prompts, adapters, greedy outputs without speculation) of a batch mixing the base model and a4, a8."""
    adapters = {name: adapter_dirs[name] for name in ("a4", "a8")}
    prompts = random_prompts([7, 12, 9, 6, 11, 8], vocab_size=200, seed=11)
    prompts[3] = prompts[2][:8] + prompts[3]  # a prefix hit on a8's pages
    reference, _ = generate(llama_dir, prompts, adapters=adapters, names=MIXED_NAMES)
    return prompts, adapters, reference


def test_a_draft_adapter_drafts_for_its_namesake(llama_dir, adapter_dirs, mixed):
    """The draft model is the target and a8's draft adapter is a8 itself: a8's drafts are all accepted, as the base's;
    a4 (no draft adapter) drafts with the bare draft and has some rejected; without a8's draft adapter so has a8."""
    prompts, adapters, reference = mixed
    itself = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(llama_dir)}
    acceptance = {}
    for draft_adapters in ([], [f"a8={adapter_dirs['a8']}"]):
        outputs, sched = generate(llama_dir, prompts, itself, adapters=adapters, names=MIXED_NAMES,
                                  speculative_lora_modules=draft_adapters)  # fmt: skip
        assert outputs == reference
        counts = {c.lora_id: c for c in sched.stats(op_id=0).spec}
        assert set(counts) == {None, ADAPTER_IDS["a4"], ADAPTER_IDS["a8"]}
        assert counts[None].num_accepted_tokens == counts[None].num_draft_tokens > 0
        a4 = counts[ADAPTER_IDS["a4"]]
        assert a4.num_accepted_tokens < a4.num_draft_tokens  # the bare draft model misses a4's changes
        acceptance[bool(draft_adapters)] = {lora_id: c.num_accepted_tokens / c.num_draft_tokens
                                            for lora_id, c in counts.items()}  # fmt: skip
    a8 = ADAPTER_IDS["a8"]
    assert acceptance[False][a8] < 1.0 and acceptance[True][a8] == 1.0, acceptance
    assert acceptance[True][ADAPTER_IDS["a4"]] == acceptance[False][ADAPTER_IDS["a4"]]


def test_greedy_with_an_eagle3_head_equals_greedy_without(llama_dir, mixed, tmp_path):
    """Any head's drafts leave greedy outputs as they are (verification decides): base and two adapters in one batch,
    prefill chunks and a prefix hit; every request drafted."""
    prompts, adapters, reference = mixed
    build_eagle3_head(llama_dir, tmp_path / "head", draft_vocab_size=400, aux_layer_ids=(0, 1, 1), seed=3,
                      with_embedding=False)  # fmt: skip
    eagle3 = {"method": "eagle3", "num_speculative_tokens": 3, "model": str(tmp_path / "head")}
    outputs, sched = generate(llama_dir, prompts, eagle3, adapters=adapters, names=MIXED_NAMES)
    assert outputs == reference
    counts = {c.lora_id: c for c in sched.stats(op_id=0).spec}
    assert set(counts) == {None, ADAPTER_IDS["a4"], ADAPTER_IDS["a8"]}
    assert all(c.num_draft_tokens > 0 and c.num_verify_passes > 0 for c in counts.values())
