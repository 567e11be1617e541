"""Helpers shared by the speculative decoding tests (no tests here): the real scheduler and a real worker
(ModelRunner) in one loop, on one rank or as one rank of a TP group."""

from __future__ import annotations

from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import (
    AdapterReport,
    BatchResult,
    LoadAdapters,
    OutputConstraint,
    SamplingParams,
    TokenizedGenerateReq,
)
from loraplex.scheduler.scheduler import Scheduler
from loraplex.worker.model_runner import ModelRunner

from tests.lora_helpers import ADAPTER_IDS, LORA_CONFIG, specs
from tests.worker_helpers import NUM_PAGES, PAGE_SIZE, random_prompts

MAX_NEW = 12
MIXED_NAMES = [None, "a4", "a8", "a8", "a4", None]  # mixed_prompts' adapters: the base model and two adapters


def mixed_prompts() -> list[list[int]]:
    """Six prompts for MIXED_NAMES, each a random run said twice (the n-gram proposer finds its suffix), the fourth
    after the third's first 8 tokens (a prefix hit on a8's pages)."""
    prompts = [p + p for p in random_prompts([4, 6, 5, 3, 6, 4], vocab_size=200, seed=11)]
    prompts[3] = prompts[2][:8] + prompts[3]
    return prompts


def processed_sampling(model_dir, num_prompts: int) -> list[SamplingParams]:
    """Greedy sampling whose verify rows are processed (worker/speculative.py), in turn: penalties with logprobs, a
    grammar (no "e" in any token) with logprobs, the grammar with a frequency penalty, and plain."""
    from transformers import AutoTokenizer

    grammar = {"constraint": OutputConstraint("regex", "[^e]*"),
               "stop_token_ids": [AutoTokenizer.from_pretrained(str(model_dir)).eos_token_id]}  # fmt: skip
    kinds = [{"repetition_penalty": 1.5, "frequency_penalty": 0.7, "presence_penalty": 0.4, "logprobs": 2},
             {**grammar, "logprobs": 1}, {**grammar, "frequency_penalty": 1.0}, {}]  # fmt: skip
    return [SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, **kinds[i % len(kinds)])
            for i in range(num_prompts)]  # fmt: skip


def generate(model_dir, prompts: list[list[int]], speculative_config: dict | None = None, *,
             adapters: dict | None = None, names: list[str | None] | None = None, rank: int = 0, tp: int = 1,
             lora_ids: dict[str, int] = ADAPTER_IDS, lora_config: dict = LORA_CONFIG,
             sampling: list[SamplingParams] | None = None, logprobs: dict | None = None,
             **config_kwargs) -> tuple[dict, Scheduler]:  # fmt: skip
    """Every prompt's greedy tokens through Scheduler + ModelRunner in one loop (prefill chunks of 8 tokens), prompt i
    on adapter names[i] of `adapters` (name -> directory, loaded on both first). With tp 2, call it on both ranks of a
    TP group (tests/worker_helpers.tp_group): each rank's own scheduler plans the same batches. lora_ids: each
    adapter name's id (lora_helpers' by default). sampling: prompt i's parameters (default greedy, MAX_NEW tokens);
    logprobs: filled with each rid's output logprobs (their TokenLogprob entries) where its sampling asks."""
    lora = lora_config if adapters else {}
    config = ServerConfig(device="cpu", tp=tp, page_size=PAGE_SIZE, max_total_tokens=NUM_PAGES * PAGE_SIZE,
                          speculative_config=speculative_config or {}, **lora, **config_kwargs)  # fmt: skip
    runner = ModelRunner(config, str(model_dir), rank=rank, world_size=tp, device="cpu")
    sched = Scheduler(config, num_pages=NUM_PAGES, context_length=256, chunked_prefill_size=8)
    if adapters:
        op = LoadAdapters(op_id=1, adapters=specs(adapters, {name: lora_ids[name] for name in adapters}))
        assert sched.load_adapters(op, now=0.0) == op
        outcomes = runner.lora.load(op.adapters)
        assert all(o.success for o in outcomes), outcomes
        assert sched.add_adapter_report(AdapterReport(op_id=1, tp_rank=0, outcomes=outcomes)) is not None
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0) if sampling is None else sampling[i]
        lora_id = None if names is None or names[i] is None else lora_ids[names[i]]
        req = TokenizedGenerateReq(rid=f"r{i}", input_ids=prompt, sampling=params, lora_id=lora_id)
        assert sched.add_request(req) == []
    for _ in range(500):
        batch = sched.schedule()
        if batch is None:
            break
        step = runner.step(batch)
        result = BatchResult(batch_id=batch.batch_id, next_token_ids=step.tokens, accepted_ids=step.accepted_ids,
                             logprobs=step.logprobs, accepted_logprobs=step.accepted_logprobs)  # fmt: skip
        for delta in sched.process_result(result):
            assert delta.finish_reason in (None, "length", "stop"), delta  # "stop": a stop token the sampling names
            outputs.setdefault(delta.rid, []).extend(delta.token_ids)
            if logprobs is not None and delta.logprobs:
                logprobs.setdefault(delta.rid, []).extend(delta.logprobs)
    assert sched.is_idle and sched.cache.num_in_use == 0
    return outputs, sched
