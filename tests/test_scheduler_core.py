"""Scheduler on plain ints: the test plays the workers and checks every invariant after every step."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable

import pytest

from protocol.config import ServerConfig
from protocol.structs import (
    BatchResult,
    DropAdapters,
    ForwardBatch,
    ForwardReq,
    LoadLoRAAdapterReqInput,
    LoadLoRAAdapterReqOutput,
    LoRAAdapterResult,
    LoRAAdapterSpec,
    SamplingParams,
    TokenDelta,
    TokenizedGenerateReq,
    UnloadLoRAAdapterReqInput,
    WorkerAdapterReport,
)
from scheduler.adapter_table import AdapterOpDone
from scheduler.batch_policy import BatchPolicy
from scheduler.scheduler import Scheduler

TOKEN = 7


def make_scheduler(
    *, num_pages=64, page_size=4, num_slots=2, max_running=8, max_prefill=1024, context_length=512, num_ranks=1
) -> Scheduler:
    config = ServerConfig(
        page_size=page_size,
        max_loras_per_batch=num_slots,
        max_running_requests=max_running,
        max_prefill_tokens=max_prefill,
    )
    return Scheduler(config, num_pages=num_pages, context_length=context_length, num_ranks=num_ranks)


def gen(rid: str, *, prompt_len=4, max_new=4, lora: int | None = None, stop: tuple[int, ...] = ()):
    sampling = SamplingParams(max_new_tokens=max_new, stop_token_ids=list(stop))
    return TokenizedGenerateReq(rid=rid, input_ids=list(range(1, prompt_len + 1)), sampling=sampling, lora_id=lora)


def spec(lora_id: int, pinned=False) -> LoRAAdapterSpec:
    return LoRAAdapterSpec(lora_name=f"a{lora_id}", lora_path=f"/adapters/{lora_id}", pinned=pinned, lora_id=lora_id)


def ok(rank: int, lora_id: int) -> LoRAAdapterResult:
    return LoRAAdapterResult(lora_name=f"a{lora_id}", success=True, lora_id=lora_id, rank=8, target_modules=["q_proj"])


def load(sched: Scheduler, *lora_ids: int, pinned=False) -> LoadLoRAAdapterReqOutput:
    """Load through every rank, all succeeding."""
    out = sched.load_adapters(LoadLoRAAdapterReqInput(adapters=[spec(i, pinned) for i in lora_ids]))
    if isinstance(out, AdapterOpDone):
        return out.reply
    for rank in range(sched.adapters.num_ranks):
        results = [ok(rank, s.lora_id) for s in out.adapters]
        done = sched.add_adapter_report(WorkerAdapterReport(rank=rank, results=results))
    assert done is not None and done.drop is None
    return done.reply


class Workers:
    """Plays the workers: applies slot loads, answers each batch, records deltas, checks invariants."""

    def __init__(self, sched: Scheduler, next_token: Callable[[str, ForwardReq], int] = lambda rid, fwd: TOKEN):
        self.sched = sched
        self.next_token = next_token
        self.outputs: dict[str, list[int]] = defaultdict(list)
        self.finished: dict[str, TokenDelta] = {}
        self.slot_contents: dict[int, int] = {}  # the workers' view of the slots
        self.batches: list[ForwardBatch] = []
        self.prefilled_at: dict[str, int] = {}  # rid -> step index of its prefill

    def record(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            assert delta.rid not in self.finished, f"delta for {delta.rid} after it finished"
            self.outputs[delta.rid] += delta.token_ids
            if delta.finish_reason is not None:
                self.finished[delta.rid] = delta

    def step(self, error_message: str = "") -> ForwardBatch | None:
        sched = self.sched
        batch = sched.schedule()
        if batch is None:
            assert not sched.running and not sched.waiting
            return None
        reqs = sched.in_flight_requests  # the batch's requests, in its order
        self.check_batch(batch, reqs)
        for req, fwd in zip(reqs, batch.reqs, strict=True):
            if fwd.num_cached_tokens == 0:
                self.prefilled_at[req.rid] = len(self.batches)
        self.batches.append(batch)
        pairs = zip(reqs, batch.reqs, strict=True)
        tokens = [] if error_message else [self.next_token(req.rid, fwd) for req, fwd in pairs]
        self.record(
            sched.process_result(
                BatchResult(batch_id=batch.batch_id, next_token_ids=tokens, error_message=error_message)
            )
        )
        self.check_accounting()
        return batch

    def check_batch(self, batch: ForwardBatch, reqs) -> None:
        sched = self.sched
        config = sched.config
        assert len(batch.reqs) == len(reqs) <= config.max_running_requests
        for load in batch.slot_loads:
            self.slot_contents[load.slot] = load.lora_id
        lora_ids = {req.lora_id for req in reqs if req.lora_id is not None}
        assert len(lora_ids) <= config.max_loras_per_batch
        slots = [fwd.slot for fwd in batch.reqs]
        assert slots == sorted(slots)  # one segment per adapter
        num_prefills, num_prefill_tokens = 0, 0
        for req, fwd in zip(reqs, batch.reqs, strict=True):
            if req.lora_id is None:
                assert fwd.slot == -1
            else:
                assert 0 <= fwd.slot < config.max_loras_per_batch
                assert self.slot_contents.get(fwd.slot) == req.lora_id, "request runs in a slot holding another adapter"
            if fwd.num_cached_tokens == 0:
                assert fwd.input_ids == req.prompt_ids and fwd.num_generated == 0
                num_prefills += 1
                num_prefill_tokens += len(fwd.input_ids)
            else:
                assert fwd.num_cached_tokens == req.num_tokens - 1
                assert fwd.input_ids == req.output_ids[-1:] and fwd.num_generated == len(req.output_ids)
            assert len(fwd.page_ids) * config.page_size >= fwd.num_cached_tokens + len(fwd.input_ids)
            assert fwd.page_ids == req.page_ids[: len(fwd.page_ids)]
        assert num_prefills <= 1 or num_prefill_tokens <= config.max_prefill_tokens

    def check_accounting(self) -> None:
        sched = self.sched
        page_ids = [p for req in sched.running.values() for p in req.page_ids]
        assert len(page_ids) == len(set(page_ids)) == sched.pages.num_used
        holds = defaultdict(int)
        for req in sched.running.values():
            assert len(req.page_ids) == req.num_pages_needed(sched.page_size)
            if req.lora_id is not None:
                holds[req.lora_id] += 1
        assert {i: sched.slots.num_holds(i) for i in sched.slots.held_lora_ids()} == dict(holds)

    def run_until_idle(self, max_steps=10_000) -> None:
        for _ in range(max_steps):
            if self.step() is None:
                return
        raise AssertionError("scheduler did not become idle")


def assert_drained(sched: Scheduler) -> None:
    """Nothing leaked: every page free, no slot held, no request left."""
    assert not sched.running and not sched.waiting and not sched.has_batch_in_flight
    assert sched.pages.num_free == sched.pages.num_pages and sched.pages.usage == 0
    assert sched.slots.held_lora_ids() == set()


# ---- continuous batching -----------------------------------------------------------------------------------


def test_new_requests_join_while_others_decode():
    sched = make_scheduler(max_running=2)
    workers = Workers(sched)
    sched.add_request(gen("a", max_new=3))
    sched.add_request(gen("b", max_new=6))
    sched.add_request(gen("c", max_new=3))
    first = workers.step()
    assert len(first.reqs) == 2 and all(fwd.num_cached_tokens == 0 for fwd in first.reqs)
    workers.step()
    workers.step()  # a finishes here
    assert workers.finished["a"].finish_reason == "length" and workers.outputs["a"] == [TOKEN] * 3
    mixed = workers.step()
    assert [fwd.num_cached_tokens for fwd in mixed.reqs] == [4 + 2, 0]  # b decodes while c prefills
    sched.add_request(gen("d", max_new=2))
    workers.run_until_idle()
    assert set(workers.finished) == {"a", "b", "c", "d"}
    assert all(len(workers.outputs[rid]) == n for rid, n in {"b": 6, "c": 3, "d": 2}.items())
    assert_drained(sched)


def test_a_finishing_request_frees_the_pages_that_admit_a_waiting_one():
    sched = make_scheduler(num_pages=3, page_size=4)  # 12 tokens: one request of 4 + 8 at a time
    workers = Workers(sched)
    sched.add_request(gen("a", max_new=8))
    sched.add_request(gen("b", max_new=8))
    for _ in range(8):
        batch = workers.step()
        assert len(batch.reqs) == 1
        assert sched.stats().num_waiting == 1
    assert workers.finished["a"].finish_reason == "length"
    assert workers.step().reqs[0].num_cached_tokens == 0  # b's prefill, on a's pages
    workers.run_until_idle()
    assert len(workers.outputs["b"]) == 8
    assert_drained(sched)


def test_page_table_grows_with_the_sequence():
    sched = make_scheduler(page_size=4)
    workers = Workers(sched)
    sched.add_request(gen("a", prompt_len=3, max_new=10))
    assert len(workers.step().reqs[0].page_ids) == 1  # 3 prompt tokens
    assert len(workers.step().reqs[0].page_ids) == 1  # + 1 = 4
    assert len(workers.step().reqs[0].page_ids) == 2  # + 1 = 5
    workers.run_until_idle()
    assert_drained(sched)


# ---- finishing -----------------------------------------------------------------------------------------------


def test_stop_token_and_max_new_tokens():
    sched = make_scheduler()
    counts = defaultdict(int)

    def next_token(rid, fwd):
        counts[rid] += 1
        return 2 if counts[rid] == 3 else TOKEN

    workers = Workers(sched, next_token)
    sched.add_request(gen("stops", max_new=10, stop=(2, 99)))
    sched.add_request(gen("ignores", max_new=5))  # 2 is not one of its stop tokens
    workers.run_until_idle()
    assert workers.finished["stops"].finish_reason == "stop"
    assert workers.outputs["stops"] == [TOKEN, TOKEN, 2]
    assert workers.finished["ignores"].finish_reason == "length"
    assert workers.outputs["ignores"] == [TOKEN, TOKEN, 2, TOKEN, TOKEN]
    assert_drained(sched)


def test_zero_max_new_tokens_finishes_at_once():
    sched = make_scheduler()
    deltas = sched.add_request(gen("a", max_new=0))
    assert deltas == [TokenDelta(rid="a", token_ids=[], finish_reason="length")]
    assert sched.schedule() is None


def test_abort_waiting_and_running():
    sched = make_scheduler(max_running=1)
    workers = Workers(sched)
    sched.add_request(gen("run", max_new=10))
    sched.add_request(gen("wait", max_new=10))
    workers.step()
    assert sched.abort("wait") == [TokenDelta(rid="wait", token_ids=[], finish_reason="abort")]
    assert sched.abort("nobody") == []
    # Abort while a pass is in flight: the pages stay with the workers until it returns.
    batch = sched.schedule()
    assert sched.abort("run") == []
    assert sched.abort("run") == []  # a second abort adds nothing
    assert sched.pages.num_used > 0
    deltas = sched.process_result(BatchResult(batch_id=batch.batch_id, next_token_ids=[TOKEN]))
    assert deltas == [TokenDelta(rid="run", token_ids=[], finish_reason="abort")]
    assert_drained(sched)
    assert sched.schedule() is None


def test_abort_running_between_passes_frees_at_once():
    sched = make_scheduler()
    workers = Workers(sched)
    sched.add_request(gen("a", lora=None))
    workers.step()
    assert sched.abort("a") == [TokenDelta(rid="a", token_ids=[], finish_reason="abort")]
    assert_drained(sched)


def test_batch_error_fails_the_batch_requests_only():
    sched = make_scheduler(max_running=2)
    workers = Workers(sched)
    for rid in "abc":
        sched.add_request(gen(rid))
    workers.step(error_message="CUDA out of memory")
    for rid in "ab":
        assert workers.finished[rid].finish_reason == "error"
        assert workers.finished[rid].error_message == "CUDA out of memory"
    workers.run_until_idle()
    assert workers.finished["c"].finish_reason == "length"
    assert_drained(sched)


def test_result_with_the_wrong_token_count_fails_the_batch():
    sched = make_scheduler()
    sched.add_request(gen("a"))
    sched.add_request(gen("b"))
    batch = sched.schedule()
    deltas = sched.process_result(BatchResult(batch_id=batch.batch_id, next_token_ids=[TOKEN]))
    assert [d.finish_reason for d in deltas] == ["error", "error"]
    assert "1 tokens for 2 requests" in deltas[0].error_message
    assert_drained(sched)


def test_results_out_of_turn_raise():
    sched = make_scheduler()
    with pytest.raises(ValueError):
        sched.process_result(BatchResult(batch_id=0, next_token_ids=[]))
    sched.add_request(gen("a"))
    batch = sched.schedule()
    with pytest.raises(RuntimeError):
        sched.schedule()
    with pytest.raises(ValueError):
        sched.process_result(BatchResult(batch_id=batch.batch_id + 1, next_token_ids=[TOKEN]))


@pytest.mark.parametrize(
    "req, message",
    [
        (gen("a", prompt_len=20, max_new=20), "exceeds the KV cache capacity (32 tokens)"),
        (gen("a", prompt_len=10, max_new=40), "exceeds the context length (45)"),
        (gen("a", prompt_len=0), "empty prompt"),
        (gen("a", max_new=-1), "max_new_tokens must be >= 0"),
        (gen("a", lora=5), "adapter 5 not loaded"),
    ],
)
def test_requests_that_can_never_run_fail_at_once(req, message):
    sched = make_scheduler(num_pages=8, page_size=4, context_length=45)
    deltas = sched.add_request(req)
    assert len(deltas) == 1 and deltas[0].finish_reason == "error" and message in deltas[0].error_message
    assert sched.is_idle


def test_a_request_that_fits_only_an_empty_cache_waits_rather_than_fails():
    sched = make_scheduler(num_pages=8, page_size=4)
    workers = Workers(sched)
    sched.add_request(gen("small", max_new=8))
    workers.step()
    assert sched.add_request(gen("whole", prompt_len=16, max_new=16)) == []  # all 32 tokens: waits for "small"
    workers.run_until_idle()
    assert workers.finished["whole"].finish_reason == "length"
    assert workers.prefilled_at["whole"] == 8
    assert_drained(sched)


def test_duplicate_rid_is_refused():
    sched = make_scheduler()
    assert sched.add_request(gen("a")) == []
    deltas = sched.add_request(gen("a"))
    assert deltas[0].finish_reason == "error" and "already in progress" in deltas[0].error_message
    assert sched.stats().num_waiting == 1


# ---- limits ----------------------------------------------------------------------------------------------------


def test_max_running_requests_is_respected():
    sched = make_scheduler(max_running=3)
    workers = Workers(sched)
    for i in range(10):
        sched.add_request(gen(f"r{i}", max_new=1 + i % 4))
    workers.run_until_idle()
    assert max(len(batch.reqs) for batch in workers.batches) == 3
    assert len(workers.finished) == 10
    assert_drained(sched)


def test_prefill_token_budget():
    sched = make_scheduler(max_prefill=10)
    workers = Workers(sched)
    sched.add_request(gen("long", prompt_len=25, max_new=2))  # over budget, but alone: admitted
    for i in range(4):
        sched.add_request(gen(f"r{i}", prompt_len=4, max_new=2))
    assert [fwd.num_cached_tokens for fwd in workers.step().reqs] == [0]
    second = workers.step()
    assert [len(fwd.input_ids) for fwd in second.reqs] == [1, 4, 4]  # long decodes; two prompts fill the budget
    workers.run_until_idle()
    assert len(workers.finished) == 5
    assert_drained(sched)


def test_stats():
    sched = make_scheduler(num_pages=10, num_slots=2, max_running=2)
    load(sched, 1, 2)
    workers = Workers(sched)
    sched.add_request(gen("a", lora=2))
    sched.add_request(gen("b"))
    sched.add_request(gen("c", lora=1))
    workers.step()
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 1)
    assert stats.kv_usage == pytest.approx(4 / 10)
    assert stats.running_lora_ids == [2] and stats.waiting_lora_ids == [1]
    assert stats.slot_lora_ids == [2, -1]
    workers.run_until_idle()
    assert_drained(sched)


# ---- adapters and slots -------------------------------------------------------------------------------------------


def test_more_adapters_than_slots_all_complete():
    sched = make_scheduler(num_pages=200, num_slots=2, max_running=6)
    load(sched, *range(6))
    workers = Workers(sched)
    for i in range(30):
        lora = [0, 1, 2, 3, 4, 5, None][i % 7]
        sched.add_request(gen(f"r{i}", prompt_len=1 + i % 5, max_new=1 + (i * 7) % 9, lora=lora))
    workers.run_until_idle()
    assert len(workers.finished) == 30
    assert all(delta.finish_reason == "length" for delta in workers.finished.values())
    assert sum(len(batch.slot_loads) for batch in workers.batches) >= 6  # slots were reused for other adapters
    assert_drained(sched)


def test_slot_is_kept_for_a_resident_adapter():
    sched = make_scheduler(num_slots=2)
    load(sched, 1)
    workers = Workers(sched)
    sched.add_request(gen("a", lora=1, max_new=1))
    assert [(s.slot, s.lora_id) for s in workers.step().slot_loads] == [(0, 1)]
    sched.add_request(gen("b", lora=1, max_new=1))
    assert workers.step().slot_loads == []  # still resident: no copy for the workers
    assert_drained(sched)


def hot_stream(num_slots: int, max_new: int, *, cold_at: int, num_steps: int):
    """Hot adapters get a new request every step; a cold adapter's request arrives at step cold_at."""
    sched = make_scheduler(num_pages=1000, num_slots=num_slots, max_running=64)
    hot_ids = list(range(num_slots))
    load(sched, *hot_ids, 99)
    workers = Workers(sched)
    for step in range(num_steps):
        for lora_id in hot_ids:
            sched.add_request(gen(f"hot{lora_id}-{step}", max_new=max_new, lora=lora_id))
        sched.add_request(gen(f"base-{step}", max_new=max_new))
        if step == cold_at:
            sched.add_request(gen("cold", max_new=max_new, lora=99))
        workers.step()
    return sched, workers


@pytest.mark.parametrize("num_slots", [1, 2])
def test_no_starvation_of_a_cold_adapter_behind_hot_ones(num_slots):
    max_new, cold_at = 8, 5
    sched, workers = hot_stream(num_slots, max_new, cold_at=cold_at, num_steps=40)
    waited = workers.prefilled_at["cold"] - cold_at
    # The bound from batch_policy: blocked head at step t is admitted by t + D + 1, D <= max_new_tokens.
    assert 0 < waited <= max_new + 1
    # Base requests kept flowing while the cold request waited.
    assert all(workers.prefilled_at[f"base-{step}"] == step for step in range(cold_at, cold_at + waited))
    workers.run_until_idle()
    assert workers.finished["cold"].finish_reason == "length" and len(workers.finished) == 40 * (num_slots + 1) + 1
    assert_drained(sched)


def test_without_a_draining_adapter_the_cold_request_would_starve(monkeypatch):
    # The control for the test above: the same stream starves the cold request if no adapter drains.
    monkeypatch.setattr(BatchPolicy, "_pick_draining", staticmethod(lambda batch, slots: None))
    sched, workers = hot_stream(1, 8, cold_at=5, num_steps=40)
    assert "cold" not in workers.prefilled_at


def test_pinned_adapter_keeps_its_slot_while_others_rotate():
    sched = make_scheduler(num_pages=200, num_slots=2)
    load(sched, 1, pinned=True)
    load(sched, 2, 3, 4)
    workers = Workers(sched)
    sched.add_request(gen("pinned", lora=1, max_new=1))
    workers.step()
    pinned_slot = sched.slots.slot_of(1)
    for i in range(12):
        sched.add_request(gen(f"r{i}", lora=2 + i % 3, max_new=2))
    workers.run_until_idle()
    assert sched.slots.slot_of(1) == pinned_slot
    assert all(load.slot != pinned_slot for batch in workers.batches[1:] for load in batch.slot_loads)
    assert_drained(sched)


# ---- adapter load / unload --------------------------------------------------------------------------------------


def test_load_succeeds_when_every_rank_succeeds():
    sched = make_scheduler(num_ranks=2)
    out = sched.load_adapters(LoadLoRAAdapterReqInput(adapters=[spec(3)]))
    assert isinstance(out, LoadLoRAAdapterReqInput) and [s.lora_id for s in out.adapters] == [3]
    assert sched.add_adapter_report(WorkerAdapterReport(rank=1, results=[ok(1, 3)])) is None
    assert not sched.adapters.is_loaded(3)  # not before every rank reported
    done = sched.add_adapter_report(WorkerAdapterReport(rank=0, results=[ok(0, 3)]))
    assert done.drop is None and done.reply.success
    assert done.reply.results == [
        LoRAAdapterResult(lora_name="a3", success=True, lora_id=3, rank=8, target_modules=["q_proj"])
    ]
    assert sched.add_request(gen("x", lora=3)) == []


def test_load_failing_on_one_rank_is_dropped_everywhere_and_unusable():
    sched = make_scheduler(num_ranks=2)
    out = sched.load_adapters(LoadLoRAAdapterReqInput(adapters=[spec(3), spec(4)]))
    assert len(out.adapters) == 2
    sched.add_adapter_report(WorkerAdapterReport(rank=0, results=[ok(0, 3), ok(0, 4)]))
    failed = LoRAAdapterResult(lora_name="a4", success=False, error_message="shape mismatch in q_proj", lora_id=4)
    done = sched.add_adapter_report(WorkerAdapterReport(rank=1, results=[ok(1, 3), failed]))
    assert done.drop == DropAdapters(lora_ids=[4])
    ok3, bad4 = done.reply.results
    assert ok3.success and not bad4.success and not done.reply.success
    assert bad4.error_message == "rank 1: shape mismatch in q_proj"
    assert "a4" in done.reply.error_message and "rank 1" in done.reply.error_message
    deltas = sched.add_request(gen("x", lora=4))
    assert deltas[0].finish_reason == "error" and "adapter 4 not loaded" in deltas[0].error_message
    assert sched.add_request(gen("y", lora=3)) == []


def test_load_failing_on_every_rank_alike_keeps_the_message_and_drops_nothing():
    sched = make_scheduler(num_ranks=2)
    sched.load_adapters(LoadLoRAAdapterReqInput(adapters=[spec(3)]))
    error = "rank 64 above --max-lora-rank 16"
    failed = LoRAAdapterResult(lora_name="a3", success=False, error_message=error, lora_id=3)
    sched.add_adapter_report(WorkerAdapterReport(rank=0, results=[failed]))
    done = sched.add_adapter_report(WorkerAdapterReport(rank=1, results=[failed]))
    assert done.drop is None
    assert done.reply.results[0].error_message == "rank 64 above --max-lora-rank 16"
    assert not sched.adapters.is_loaded(3)


def test_a_rank_report_missing_an_adapter_fails_it():
    sched = make_scheduler(num_ranks=2)
    sched.load_adapters(LoadLoRAAdapterReqInput(adapters=[spec(3)]))
    sched.add_adapter_report(WorkerAdapterReport(rank=0, results=[ok(0, 3)]))
    done = sched.add_adapter_report(WorkerAdapterReport(rank=1, results=[]))
    assert not done.reply.results[0].success and done.reply.results[0].error_message.startswith("rank 1: ")
    assert done.drop == DropAdapters(lora_ids=[3])


def test_concurrent_loads_match_reports_in_order():
    sched = make_scheduler(num_ranks=2)
    sched.load_adapters(LoadLoRAAdapterReqInput(adapters=[spec(1)]))
    sched.load_adapters(LoadLoRAAdapterReqInput(adapters=[spec(2)]))
    assert sched.add_adapter_report(WorkerAdapterReport(rank=0, results=[ok(0, 1)])) is None
    assert sched.add_adapter_report(WorkerAdapterReport(rank=0, results=[ok(0, 2)])) is None
    first = sched.add_adapter_report(WorkerAdapterReport(rank=1, results=[ok(1, 1)]))
    second = sched.add_adapter_report(WorkerAdapterReport(rank=1, results=[ok(1, 2)]))
    assert [r.lora_id for r in first.reply.results] == [1] and [r.lora_id for r in second.reply.results] == [2]
    assert sched.adapters.loaded_ids == {1, 2}
    assert sched.add_adapter_report(WorkerAdapterReport(rank=1, results=[ok(1, 2)])) is None  # matches no load


def test_pinned_limit():
    sched = make_scheduler(num_slots=3)
    assert load(sched, 1, pinned=True).success
    out = sched.load_adapters(LoadLoRAAdapterReqInput(adapters=[spec(2, pinned=True), spec(3, pinned=True), spec(4)]))
    assert [s.lora_id for s in out.adapters] == [2, 4]  # 3 is refused before reaching the ranks
    done = sched.add_adapter_report(WorkerAdapterReport(rank=0, results=[ok(0, 2), ok(0, 4)]))
    refused = done.reply.results[1]
    assert [r.success for r in done.reply.results] == [True, False, True]
    assert refused.lora_name == "a3"
    assert refused.error_message == "too many pinned adapters (at most 2 = max_loras_per_batch - 1)"
    assert sched.slots.is_pinned(1) and sched.slots.is_pinned(2) and not sched.slots.is_pinned(4)
    only_refused = sched.load_adapters(LoadLoRAAdapterReqInput(adapters=[spec(5, pinned=True)]))
    assert isinstance(only_refused, AdapterOpDone) and not only_refused.reply.success  # the ranks are not asked


def test_duplicate_or_unminted_lora_id_is_refused():
    sched = make_scheduler()
    load(sched, 1)
    out = sched.load_adapters(LoadLoRAAdapterReqInput(adapters=[spec(1), spec(-1)]))
    assert isinstance(out, AdapterOpDone)
    assert ["already loaded" in r.error_message for r in out.reply.results] == [True, False]
    assert "no lora_id" in out.reply.results[1].error_message


def test_unload_drops_the_slot_and_fails_waiting_requests():
    sched = make_scheduler(num_slots=2, max_running=1)
    load(sched, 1, 2)
    sched.slots.pin(2)
    workers = Workers(sched)
    sched.add_request(gen("a", lora=1, max_new=1))
    workers.step()
    sched.add_request(gen("b", lora=2, max_new=2))
    sched.add_request(gen("c", lora=1))
    workers.step()  # b runs; c waits for the running place
    assert sched.slots.slot_table() == [1, 2]
    done = sched.unload_adapters(UnloadLoRAAdapterReqInput(lora_names=["a1", "ghost"], lora_ids=[1, 9]))
    assert done.drop == DropAdapters(lora_ids=[1])
    assert [r.success for r in done.reply.results] == [True, False] and "'ghost'" in done.reply.results[1].error_message
    assert [(d.rid, d.finish_reason) for d in done.deltas] == [("c", "error")]
    assert "'a1' was unloaded" in done.deltas[0].error_message
    assert sched.slots.slot_table() == [-1, 2] and not sched.adapters.is_loaded(1)
    sched.add_request(gen("d", lora=1))  # not loaded any more
    workers.run_until_idle()
    unload_2 = sched.unload_adapters(UnloadLoRAAdapterReqInput(lora_names=["a2"], lora_ids=[2]))
    assert unload_2.reply.success and not sched.slots.is_pinned(2) and sched.slots.slot_table() == [-1, -1]
    assert_drained(sched)


@pytest.mark.parametrize("seed", range(20))
def test_random_traffic_keeps_every_invariant(seed):
    rng = random.Random(seed)
    num_slots = rng.randint(1, 3)
    sched = make_scheduler(
        num_pages=rng.randint(6, 40),
        page_size=4,
        num_slots=num_slots,
        max_running=rng.randint(1, 6),
        max_prefill=rng.randint(4, 24),
        context_length=64,
    )
    load(sched, *range(num_slots - 1), pinned=True)
    load(sched, *range(num_slots - 1, 6))
    workers = Workers(sched, lambda rid, fwd: rng.choice([TOKEN] * 9 + [2]))
    rids = []
    for _ in range(60):
        for _ in range(rng.randint(0, 2)):
            rid = f"r{len(rids)}"
            rids.append(rid)
            workers.record(
                sched.add_request(
                    gen(
                        rid,
                        prompt_len=rng.randint(1, 12),
                        max_new=rng.randint(1, 12),
                        lora=rng.choice([None, *range(6)]),
                        stop=(2,),
                    )
                )
            )
        if rids and rng.random() < 0.1:
            workers.record(sched.abort(rng.choice(rids)))
        workers.step()
    workers.run_until_idle()
    assert set(workers.finished) == set(rids)
    assert {d.finish_reason for d in workers.finished.values()} <= {"stop", "length", "abort"}
    assert_drained(sched)
