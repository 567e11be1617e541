"""Speculative decoding in process: the real scheduler and a real worker (ModelRunner) in one loop. With a draft model
(DraftRunner, its KV on the target's pages), greedy outputs equal those without speculation, through prefill chunks,
prefix hits and many concurrent requests; a draft that is the target itself has every draft accepted."""

from __future__ import annotations

import pytest
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import BatchResult, SamplingParams, TokenizedGenerateReq
from loraplex.scheduler.scheduler import Scheduler
from loraplex.worker.model_runner import ModelRunner

from tests.builders import build_tiny_model
from tests.worker_helpers import NUM_PAGES, PAGE_SIZE, random_prompts

MAX_NEW = 12


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller model with the target's tokenizer (one layer, another seed): it agrees with the target sometimes."""
    path = tmp_path_factory.mktemp("draft")
    build_tiny_model(path, num_layers=1, seed=5)
    return path


def generate(model_dir, prompts: list[list[int]], speculative_config: dict | None = None) -> tuple[dict, Scheduler]:
    """Every prompt's greedy tokens through Scheduler + ModelRunner in one loop (prefill chunks of 8 tokens)."""
    config = ServerConfig(device="cpu", page_size=PAGE_SIZE, max_total_tokens=NUM_PAGES * PAGE_SIZE,
                          speculative_config=speculative_config or {})  # fmt: skip
    runner = ModelRunner(config, str(model_dir), rank=0, world_size=1, device="cpu")
    sched = Scheduler(config, num_pages=NUM_PAGES, context_length=256, chunked_prefill_size=8)
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
        assert sched.add_request(TokenizedGenerateReq(rid=f"r{i}", input_ids=prompt, sampling=sampling)) == []
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
