"""Scheduler on plain ints: the test plays the workers and checks every invariant after every step."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable

import msgspec
import pytest
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import (
    AdapterOpDone,
    AdapterOutcome,
    AdapterReport,
    AdapterToLoad,
    BatchResult,
    DropAdapters,
    ForwardBatch,
    ForwardReq,
    LoadAdapters,
    SamplingParams,
    TokenDelta,
    TokenizedGenerateReq,
)
from loraplex.scheduler.adapter_table import AdapterTable, LoadFinished
from loraplex.scheduler.batch_policy import BatchPolicy
from loraplex.scheduler.request import FREED_PAGE
from loraplex.scheduler.scheduler import Scheduler

from tests.scheduler_helpers import (
    held_lora_ids,
    in_flight_requests,
    kept_snapshots,
    num_holds,
    num_pending_loads,
    slot_of,
)

TOKEN = 7


def make_scheduler(
    *,
    num_pages=64,
    page_size=4,
    num_slots=2,
    max_running=8,
    max_prefill=1024,
    context_length=512,
    num_ranks=1,
    chunked_prefill_size=-1,
    prefix_cache=False,
    attention_window=None,
    long_rope_len=0,
    num_state_slots=0,
    num_state_snapshots=0,
    speculative_config=None,
) -> Scheduler:
    config = ServerConfig(
        speculative_config=speculative_config or {},
        page_size=page_size,
        max_loras_per_batch=num_slots,
        max_running_requests=max_running,
        max_prefill_tokens=max_prefill,
        disable_radix_cache=not prefix_cache,
    )
    return Scheduler(
        config,
        num_pages=num_pages,
        context_length=context_length,
        num_ranks=num_ranks,
        chunked_prefill_size=chunked_prefill_size,
        attention_window=attention_window,
        long_rope_len=long_rope_len,
        num_state_slots=num_state_slots,
        num_state_snapshots=num_state_snapshots,
    )


def gen(rid: str, *, prompt_len=4, max_new=4, lora: int | None = None, stop: tuple[int, ...] = ()):
    sampling = SamplingParams(max_new_tokens=max_new, stop_token_ids=list(stop))
    return TokenizedGenerateReq(rid=rid, input_ids=list(range(1, prompt_len + 1)), sampling=sampling, lora_id=lora)


def adapter(lora_id: int, pinned=False, replaces: int | None = None) -> AdapterToLoad:
    return AdapterToLoad(
        lora_id=lora_id, lora_name=f"a{lora_id}", lora_path=f"/adapters/{lora_id}", pinned=pinned, replaces=replaces
    )


def ok(lora_id: int) -> AdapterOutcome:
    return AdapterOutcome(lora_id=lora_id, success=True, lora_rank=8, target_modules=["q_proj"])


def bad(lora_id: int, message: str, kind: str = "invalid") -> AdapterOutcome:
    return AdapterOutcome(lora_id=lora_id, success=False, error_message=message, error_kind=kind)


def report(op_id: int, tp_rank: int, *outcomes: AdapterOutcome) -> AdapterReport:
    return AdapterReport(op_id=op_id, tp_rank=tp_rank, outcomes=list(outcomes))


_op_ids = iter(range(1000, 10**9))


def load(sched: Scheduler, *lora_ids: int, pinned=False) -> AdapterOpDone:
    """Load through every rank, all succeeding."""
    op = LoadAdapters(op_id=next(_op_ids), adapters=[adapter(i, pinned) for i in lora_ids])
    out = sched.load_adapters(op, now=0.0)
    assert out == op  # sent to every rank's loader as it is
    for rank in range(sched.adapters.num_ranks):
        done = sched.add_adapter_report(report(op.op_id, rank, *[ok(i) for i in lora_ids]))
    assert done is not None and done.rollback is None
    assert all(o.success for o in done.reply.outcomes)
    return done.reply


class Workers:
    """Plays the workers: applies slot loads, answers each batch, records deltas, checks invariants."""

    def __init__(self, sched: Scheduler, next_token: Callable[[str, ForwardReq], int] = lambda rid, fwd: TOKEN,
                 draft_token: Callable[[str, ForwardReq], int] | None = None):
        """draft_token: speculative decoding's draft model (method draft_model), by default the model itself."""
        self.sched = sched
        self.next_token = next_token
        self.draft_token = draft_token or next_token
        self.outputs: dict[str, list[int]] = defaultdict(list)
        self.finished: dict[str, TokenDelta] = {}
        self.deltas: dict[str, list[TokenDelta]] = defaultdict(list)  # every delta, by request
        self.slot_contents: dict[int, int] = {}  # the workers' view of the slots
        self.batches: list[ForwardBatch] = []
        self.prefilled_at: dict[str, int] = {}  # rid -> step index of its prefill
        # The workers' per-request state: req_key -> (sampling parameters, the request's preemptions when sent)
        self.kept: dict[int, tuple[SamplingParams, int]] = {}

    def record(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            assert delta.rid not in self.finished, f"delta for {delta.rid} after it finished"
            self.outputs[delta.rid] += delta.token_ids
            self.deltas[delta.rid].append(delta)
            if delta.finish_reason is not None:
                self.finished[delta.rid] = delta

    def step(self, error_message: str = "") -> ForwardBatch | None:
        sched = self.sched
        batch = sched.schedule()
        if batch is None:
            assert not sched.running and not sched.waiting
            return None
        reqs = in_flight_requests(sched)  # the batch's requests, in its order
        self.check_batch(batch, reqs)
        self.keep_state(batch, reqs)
        for req, fwd in zip(reqs, batch.reqs, strict=True):
            if fwd.num_cached_tokens == 0:
                self.prefilled_at[req.rid] = len(self.batches)
        self.batches.append(batch)
        pairs = zip(reqs, batch.reqs, strict=True)
        tokens, accepted_ids = [], []
        for req, fwd in [] if error_message else pairs:
            accepted, token = self.verify(req.rid, fwd)
            tokens.append(token)
            accepted_ids.append(accepted)
        if not any(accepted_ids):
            accepted_ids = []
        self.record(
            sched.process_result(BatchResult(batch_id=batch.batch_id, next_token_ids=tokens,
                                             error_message=error_message, accepted_ids=accepted_ids))  # fmt: skip
        )
        self.check_accounting()
        return batch

    def verify(self, rid: str, fwd: ForwardReq) -> tuple[list[int], int]:
        """Speculative decoding's verify, greedy: the drafts equal to the model's tokens, up to the first that is not,
        and the model's token after them (the model's token after input row j is next_token of the rows up to j)."""
        if fwd.num_model_drafts:  # the draft model proposes them, one after the other
            drafts = []
            for _ in range(fwd.num_model_drafts):
                prefix = msgspec.structs.replace(fwd, input_ids=fwd.input_ids + drafts, num_model_drafts=0)
                drafts.append(self.draft_token(rid, prefix))
            fwd = msgspec.structs.replace(fwd, input_ids=fwd.input_ids + drafts, num_draft_tokens=len(drafts),
                                          num_model_drafts=0)  # fmt: skip
        num_known = len(fwd.input_ids) - fwd.num_draft_tokens
        drafts, accepted = fwd.input_ids[num_known:], []
        for j in range(num_known, len(fwd.input_ids) + 1):
            token = self.next_token(rid, msgspec.structs.replace(fwd, input_ids=fwd.input_ids[:j], num_draft_tokens=0))
            if j - num_known == len(drafts) or drafts[j - num_known] != token:
                return accepted, token
            accepted.append(token)
        raise AssertionError("unreachable")

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
            # The tokens whose KV is not written yet, from the first: a prompt (chunk), a recompute, or the last token.
            cached = fwd.num_cached_tokens
            num_known = len(fwd.input_ids) - fwd.num_draft_tokens  # the drafts follow the known tokens
            assert fwd.input_ids[:num_known] == req.token_ids[cached : cached + num_known]
            assert not fwd.num_draft_tokens or (num_known == 1 and cached + 1 == req.num_tokens)
            assert not fwd.num_model_drafts or (len(fwd.input_ids) == 1 and not fwd.num_draft_tokens)
            assert fwd.num_generated == len(req.output_ids)
            if num_known > 1 or cached < len(req.prompt_ids):
                num_prefills += 1
                num_prefill_tokens += len(fwd.input_ids)
            num_positions = cached + len(fwd.input_ids) + fwd.num_model_drafts  # model drafts: positions planned
            assert len(fwd.page_ids) == -(-num_positions // config.page_size)  # no more, no less
            assert fwd.page_ids == req.page_ids
        if sched.is_chunked:
            assert num_prefill_tokens <= sched.prefill_budget + len(batch.reqs)
        else:
            assert num_prefills <= 1 or num_prefill_tokens <= sched.prefill_budget

    def keep_state(self, batch: ForwardBatch, reqs) -> None:
        """As the workers keep request state: the sampling parameters come on a request's first pass after each
        admission and on no other, a pass never needs state the workers lack, and a key is released once, after
        it was sent."""
        for key in batch.released_keys:
            assert key in self.kept, f"released key {key} was never sent, or released twice"
            del self.kept[key]
        for req, fwd in zip(reqs, batch.reqs, strict=True):
            assert fwd.req_key == req.arrival
            kept = self.kept.get(fwd.req_key)
            is_first_pass = kept is None or kept[1] != req.num_preemptions
            assert (fwd.sampling is not None) == is_first_pass, (req.rid, fwd)
            if fwd.sampling is not None:
                assert fwd.sampling == req.sampling
                self.kept[fwd.req_key] = (fwd.sampling, req.num_preemptions)

    def check_accounting(self) -> None:
        sched = self.sched
        sched.cache.check()
        # Pages given back (behind every layer's window) are not in use: they are free or cached, unused.
        page_ids = {p for req in sched.running.values() for p in req.live_page_ids}
        assert len(page_ids) == sched.cache.num_in_use  # shared cached pages count once
        private = [p for req in sched.running.values() for p in req.live_page_ids
                   if p not in sched.cache._key_of_page]  # fmt: skip
        assert len(private) == len(set(private))  # a private page belongs to one request
        holds = defaultdict(int)
        for req in sched.running.values():
            assert len(req.page_ids) == -(-req.num_cached_tokens // sched.page_size)
            window = sched.attention_window
            behind = 0 if window is None else max(0, req.num_cached_tokens - window + 1) // sched.page_size
            assert req.num_freed_pages <= behind  # never a page a query of its may still read
            assert req.page_ids[: req.num_freed_pages] == [FREED_PAGE] * req.num_freed_pages
            if req.lora_id is not None:
                holds[req.lora_id] += 1
        assert {i: num_holds(sched.slots, i) for i in held_lora_ids(sched.slots)} == dict(holds)

    def run_until_idle(self, max_steps=10_000) -> None:
        for _ in range(max_steps):
            if self.step() is None:
                return
        raise AssertionError("scheduler did not become idle")


def assert_drained(sched: Scheduler) -> None:
    """Nothing leaked: every page free, no slot held, no request left."""
    assert not sched.running and not sched.waiting and not sched.has_batch_in_flight
    assert sched.cache.num_available == sched.pages.num_pages and sched.cache.num_in_use == 0
    sched.cache.check()
    assert held_lora_ids(sched.slots) == set()
    assert sched.state_slots.num_free == sched.state_slots.num_slots
    # every snapshot is free or kept by a cached page (evictable now)
    assert sched.snapshots.num_free + len(kept_snapshots(sched.cache)) == sched.snapshots.num_slots


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


def test_when_pages_run_out_the_newest_request_is_preempted_and_recomputed():
    sched = make_scheduler(num_pages=3, page_size=4)  # 12 tokens: one request of 4 + 8 at a time
    # The tokens depend on the position only, as a deterministic model's would: a recompute must give the same.
    workers = Workers(sched, next_token=lambda rid, fwd: 100 + fwd.num_cached_tokens + len(fwd.input_ids))
    sched.add_request(gen("a", max_new=8))
    sched.add_request(gen("b", max_new=8))
    assert len(workers.step().reqs) == 2  # both start: pages are taken as they grow, not reserved
    workers.run_until_idle()
    assert sched.num_preemptions >= 1
    assert workers.outputs["a"] == workers.outputs["b"] == list(range(104, 112))
    assert {d.finish_reason for d in workers.finished.values()} == {"length"}
    assert_drained(sched)


@pytest.mark.parametrize("chunked_prefill_size", [-1, 4])
def test_longrope_requests_past_the_original_length_take_the_long_factors_everywhere(chunked_prefill_size):
    # As transformers: a sequence longer than 10 is encoded with the long factors at every position; one that grows
    # past 10 is recomputed so. The model here answers the sequence length it saw, + 1000 with the long factors.
    sched = make_scheduler(page_size=4, long_rope_len=10, prefix_cache=True, chunked_prefill_size=chunked_prefill_size)
    passes: dict[str, list[ForwardReq]] = defaultdict(list)

    def next_token(rid: str, fwd: ForwardReq) -> int:
        passes[rid].append(fwd)
        seq_len = fwd.num_cached_tokens + len(fwd.input_ids)
        return seq_len + (1000 if fwd.long_rope else 0)

    workers = Workers(sched, next_token)
    sched.add_request(gen("grows", prompt_len=4, max_new=10))
    sched.add_request(gen("long", prompt_len=12, max_new=3))
    workers.run_until_idle()
    # each output is sampled after a sequence of 4 + i tokens (12 + i): long ones past 10
    assert workers.outputs["grows"] == [n + (1000 if n > 10 else 0) for n in range(4, 14)]
    assert workers.outputs["long"] == [1012, 1013, 1014]
    assert sched.num_preemptions == 1  # "grows", once, when it passed 10
    recompute = next(i for i, fwd in enumerate(passes["grows"]) if fwd.long_rope)
    assert passes["grows"][recompute].num_cached_tokens == 0  # recomputed from the start, no cached prefix
    assert all(fwd.long_rope for fwd in passes["grows"][recompute:] + passes["long"])
    # the long requests' pages never reach the prefix cache: a repeat of "long" starts from nothing again
    sched.add_request(gen("again", prompt_len=12, max_new=1))
    workers.run_until_idle()
    assert passes["again"][0].num_cached_tokens == 0 and workers.outputs["again"] == [1012]
    # while a short request finds the page of the prompt it shares with "grows", written short before it grew
    sched.add_request(gen("short", prompt_len=9, max_new=1))
    workers.run_until_idle()
    assert passes["short"][0].num_cached_tokens == 4 and not passes["short"][0].long_rope
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
    second = sched.schedule()  # two passes in flight: the second reads the first's token
    assert second.reqs[0].prev_row == 0
    with pytest.raises(RuntimeError):
        sched.schedule()
    with pytest.raises(ValueError):  # results come back oldest first
        sched.process_result(BatchResult(batch_id=second.batch_id, next_token_ids=[TOKEN]))
    with pytest.raises(ValueError):
        sched.process_result(BatchResult(batch_id=batch.batch_id + 2, next_token_ids=[TOKEN]))


def test_longrope_recompute_waits_for_the_passes_in_flight():
    sched = make_scheduler(long_rope_len=5)
    sched.add_request(gen("a", prompt_len=4, max_new=6))
    prefill, decode = sched.schedule(), sched.schedule()  # sequences of 4 and 5 tokens: short
    assert not prefill.reqs[0].long_rope and not decode.reqs[0].long_rope and decode.reqs[0].prev_row == 0
    sched.process_result(BatchResult(batch_id=prefill.batch_id, next_token_ids=[TOKEN]))
    assert sched.schedule() is None  # its next pass would make 6 tokens: a recompute, after the pass in flight
    sched.process_result(BatchResult(batch_id=decode.batch_id, next_token_ids=[TOKEN]))
    recompute = sched.schedule()
    [fwd] = recompute.reqs
    assert fwd.long_rope and fwd.num_cached_tokens == 0 and fwd.input_ids == [1, 2, 3, 4, TOKEN, TOKEN]
    assert fwd.sampling is not None  # a new admission: its state is sent again
    sched.process_result(BatchResult(batch_id=recompute.batch_id, next_token_ids=[TOKEN]))
    assert sched.num_preemptions == 1


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
    assert sched.stats(op_id=0).num_waiting == 1


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
    stats = sched.stats(op_id=41)
    assert stats.op_id == 41
    assert (stats.num_running, stats.num_waiting) == (2, 1)
    assert stats.kv_usage == pytest.approx(2 / 10)  # one written page each: pages come as requests grow
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
    pinned_slot = slot_of(sched.slots, 1)
    for i in range(12):
        sched.add_request(gen(f"r{i}", lora=2 + i % 3, max_new=2))
    workers.run_until_idle()
    assert slot_of(sched.slots, 1) == pinned_slot
    assert all(load.slot != pinned_slot for batch in workers.batches[1:] for load in batch.slot_loads)
    assert_drained(sched)


# ---- adapter load / drop ------------------------------------------------------------------------------------------


def test_load_succeeds_when_every_rank_succeeds():
    sched = make_scheduler(num_ranks=2)
    op = LoadAdapters(op_id=1, adapters=[adapter(3)])
    assert sched.load_adapters(op, now=0.0) == op
    assert sched.add_adapter_report(report(1, 1, ok(3))) is None
    assert not sched.adapters.is_loaded(3)  # not before every rank reported
    done = sched.add_adapter_report(report(1, 0, ok(3)))
    assert done.rollback is None and done.loaded == [adapter(3)]
    assert done.reply == AdapterOpDone(op_id=1, outcomes=[ok(3)])
    assert sched.add_request(gen("x", lora=3)) == []
    assert num_pending_loads(sched.adapters) == 0


def test_load_failing_on_one_rank_is_rolled_back_everywhere_and_unusable():
    sched = make_scheduler(num_ranks=2)
    out = sched.load_adapters(LoadAdapters(op_id=7, adapters=[adapter(3), adapter(4)]), now=0.0)
    assert [a.lora_id for a in out.adapters] == [3, 4]
    assert sched.add_adapter_report(report(7, 0, ok(3), ok(4))) is None
    done = sched.add_adapter_report(report(7, 1, ok(3), bad(4, "shape mismatch in q_proj")))
    assert done.rollback == DropAdapters(op_id=7, lora_ids=[4])
    ok3, bad4 = done.reply.outcomes
    assert ok3.success and not bad4.success
    assert bad4.error_message == "rank 1: shape mismatch in q_proj" and bad4.error_kind == "invalid"
    assert [a.lora_id for a in done.loaded] == [3]
    deltas = sched.add_request(gen("x", lora=4))
    assert deltas[0].finish_reason == "error" and "adapter 4 not loaded" in deltas[0].error_message
    assert sched.add_request(gen("y", lora=3)) == []


def test_partial_failure_of_a_single_adapter_is_not_loaded_and_rolled_back():
    sched = make_scheduler(num_ranks=2)
    sched.load_adapters(LoadAdapters(op_id=1, adapters=[adapter(5)]), now=0.0)
    sched.add_adapter_report(report(1, 0, ok(5)))
    done = sched.add_adapter_report(report(1, 1, bad(5, "injected fault on rank 1", "internal")))
    assert not done.reply.outcomes[0].success and done.reply.outcomes[0].error_kind == "internal"
    assert done.reply.outcomes[0].error_message == "rank 1: injected fault on rank 1"
    assert done.rollback == DropAdapters(op_id=1, lora_ids=[5]) and done.loaded == []
    assert not sched.adapters.is_loaded(5)


def test_load_failing_on_every_rank_alike_keeps_the_message_and_rolls_back_nothing():
    sched = make_scheduler(num_ranks=2)
    sched.load_adapters(LoadAdapters(op_id=1, adapters=[adapter(3)]), now=0.0)
    error = "rank 64 above --max-lora-rank 16"
    sched.add_adapter_report(report(1, 0, bad(3, error)))
    done = sched.add_adapter_report(report(1, 1, bad(3, error)))
    assert done.rollback is None
    assert done.reply.outcomes == [bad(3, error)]
    assert not sched.adapters.is_loaded(3)


def test_a_rank_report_missing_an_adapter_fails_it():
    sched = make_scheduler(num_ranks=2)
    sched.load_adapters(LoadAdapters(op_id=1, adapters=[adapter(3)]), now=0.0)
    sched.add_adapter_report(report(1, 0, ok(3)))
    done = sched.add_adapter_report(report(1, 1))
    outcome = done.reply.outcomes[0]
    assert not outcome.success and outcome.error_message.startswith("rank 1: ") and outcome.error_kind == "internal"
    assert done.rollback == DropAdapters(op_id=1, lora_ids=[3])


def test_concurrent_loads_match_reports_by_op_id_in_any_order():
    sched = make_scheduler(num_ranks=2)
    sched.load_adapters(LoadAdapters(op_id=10, adapters=[adapter(1)]), now=0.0)
    sched.load_adapters(LoadAdapters(op_id=11, adapters=[adapter(2)]), now=0.0)
    assert num_pending_loads(sched.adapters) == 2
    # Rank 0 answers the second load first; rank 1 answers the first load first: interleaved.
    assert sched.add_adapter_report(report(11, 0, ok(2))) is None
    assert sched.add_adapter_report(report(10, 1, ok(1))) is None
    second = sched.add_adapter_report(report(11, 1, ok(2)))
    assert second.reply == AdapterOpDone(op_id=11, outcomes=[ok(2)])
    assert sched.adapters.loaded_ids == {2}
    first = sched.add_adapter_report(report(10, 0, ok(1)))
    assert first.reply == AdapterOpDone(op_id=10, outcomes=[ok(1)])
    assert sched.adapters.loaded_ids == {1, 2} and num_pending_loads(sched.adapters) == 0
    assert sched.add_adapter_report(report(11, 1, ok(2))) is None  # matches no load any more
    assert sched.add_adapter_report(report(99, 0, ok(3))) is None  # never matched one
    assert sched.adapters.loaded_ids == {1, 2}


def test_a_report_from_a_rank_outside_the_group_is_ignored():
    sched = make_scheduler(num_ranks=2)
    sched.load_adapters(LoadAdapters(op_id=1, adapters=[adapter(3)]), now=0.0)
    assert sched.add_adapter_report(report(1, 2, ok(3))) is None
    assert sched.add_adapter_report(report(1, -1, ok(3))) is None
    assert num_pending_loads(sched.adapters) == 1


def test_a_load_past_its_deadline_times_out_naming_the_missing_rank():
    table = AdapterTable(num_ranks=3, load_timeout_s=5.0)
    op = LoadAdapters(op_id=1, adapters=[adapter(3), adapter(4), adapter(5)])
    assert table.begin_load(op, now=100.0) == op
    assert table.add_report(report(1, 0, ok(3), bad(4, "bad shape"), bad(5, "bad shape"))) is None
    assert table.add_report(report(1, 2, ok(3), ok(4), bad(5, "bad shape"))) is None
    assert table.expire(104.9) == []  # not yet
    [done] = table.expire(105.0)
    assert isinstance(done, LoadFinished) and done.loaded == []
    assert [o.error_kind for o in done.reply.outcomes] == ["timeout"] * 3
    assert all(not o.success for o in done.reply.outcomes)
    message = done.reply.outcomes[0].error_message
    assert "'a3'" in message and "rank 1 did not answer" in message and "5 s" in message
    # Every id goes: some rank loaded 3 and 4, and the missing rank may still install any of them.
    assert done.rollback == DropAdapters(op_id=1, lora_ids=[3, 4, 5])
    assert not table.loaded_ids and num_pending_loads(table) == 0
    assert table.expire(1000.0) == []  # expired once
    # The late rank's report is ignored.
    assert table.add_report(report(1, 1, ok(3), ok(4), ok(5))) is None
    assert not table.loaded_ids


def test_expiry_fails_only_the_loads_past_their_deadline():
    sched = make_scheduler(num_ranks=2)
    timeout = sched.adapters.load_timeout_s
    assert timeout == sched.config.lora_load_timeout  # the scheduler's table uses the configured timeout
    sched.load_adapters(LoadAdapters(op_id=1, adapters=[adapter(1)]), now=0.0)
    sched.load_adapters(LoadAdapters(op_id=2, adapters=[adapter(2)]), now=10.0)
    sched.add_adapter_report(report(1, 0, ok(1)))
    [done] = sched.expire_adapter_loads(timeout + 1.0)
    assert done.reply.op_id == 1 and done.reply.outcomes[0].error_kind == "timeout"
    assert "rank 1 did not answer" in done.reply.outcomes[0].error_message
    assert done.rollback == DropAdapters(op_id=1, lora_ids=[1])
    assert num_pending_loads(sched.adapters) == 1
    sched.add_adapter_report(report(2, 0, ok(2)))
    assert sched.add_adapter_report(report(2, 1, ok(2))).reply.outcomes == [ok(2)]
    assert sched.add_adapter_report(report(1, 1, ok(1))) is None  # late: ignored
    assert sched.adapters.loaded_ids == {2}
    deltas = sched.add_request(gen("x", lora=1))
    assert deltas[0].finish_reason == "error" and "adapter 1 not loaded" in deltas[0].error_message


@pytest.mark.parametrize(
    "loaded, pending, adapters",
    [
        ([1], [], [adapter(1)]),  # already loaded
        ([], [2], [adapter(2)]),  # a pending load's id
        ([], [], [adapter(3), adapter(3)]),  # twice in one operation
    ],
)
def test_a_reused_lora_id_fails_without_asking_the_ranks(loaded, pending, adapters):
    sched = make_scheduler(num_ranks=2)
    if loaded:
        load(sched, *loaded)
    if pending:
        sched.load_adapters(LoadAdapters(op_id=500, adapters=[adapter(i) for i in pending]), now=0.0)
    num_pending = num_pending_loads(sched.adapters)
    out = sched.load_adapters(LoadAdapters(op_id=1, adapters=[*adapters, adapter(9)]), now=0.0)
    assert isinstance(out, LoadFinished)  # the reply at once: nothing went to the ranks
    assert out.rollback is None and out.loaded == []
    assert out.reply.op_id == 1 and len(out.reply.outcomes) == len(adapters) + 1
    assert all(not o.success and o.error_kind == "internal" for o in out.reply.outcomes)
    assert "reuses" in out.reply.outcomes[0].error_message
    assert num_pending_loads(sched.adapters) == num_pending
    assert not sched.adapters.is_loaded(9)
    assert sched.adapters.loaded_ids == set(loaded)


def test_a_reused_op_id_fails_without_asking_the_ranks():
    sched = make_scheduler(num_ranks=2)
    sched.load_adapters(LoadAdapters(op_id=1, adapters=[adapter(1)]), now=0.0)
    out = sched.load_adapters(LoadAdapters(op_id=1, adapters=[adapter(2)]), now=0.0)
    assert isinstance(out, LoadFinished) and out.rollback is None
    assert out.reply.op_id == 1 and not out.reply.outcomes[0].success
    assert "operation 1" in out.reply.outcomes[0].error_message
    # The first operation is untouched: its reports still complete it.
    sched.add_adapter_report(report(1, 0, ok(1)))
    assert sched.add_adapter_report(report(1, 1, ok(1))).reply.outcomes == [ok(1)]
    assert sched.adapters.loaded_ids == {1}


def test_pins_follow_the_operation():
    sched = make_scheduler(num_slots=3)
    load(sched, 1, pinned=True)
    load(sched, 2)
    assert sched.slots.is_pinned(1) and not sched.slots.is_pinned(2)


def test_a_failed_load_pins_nothing():
    sched = make_scheduler(num_slots=3, num_ranks=2)
    sched.load_adapters(LoadAdapters(op_id=1, adapters=[adapter(1, pinned=True)]), now=0.0)
    sched.add_adapter_report(report(1, 0, ok(1)))
    sched.add_adapter_report(report(1, 1, bad(1, "no")))
    assert not sched.slots.is_pinned(1)
    sched.load_adapters(LoadAdapters(op_id=2, adapters=[adapter(2, pinned=True)]), now=0.0)
    sched.expire_adapter_loads(10**6)
    assert not sched.slots.is_pinned(2)


def test_an_in_place_reload_moves_the_pin():
    sched = make_scheduler(num_slots=2)  # one pin at most
    load(sched, 1, pinned=True)
    assert sched.slots.is_pinned(1)
    op = LoadAdapters(op_id=1, adapters=[adapter(2, pinned=True, replaces=1)])
    sched.load_adapters(op, now=0.0)
    assert sched.slots.is_pinned(1) and not sched.slots.is_pinned(2)  # nothing moves before the ranks answer
    done = sched.add_adapter_report(report(1, 0, ok(2)))
    assert done.loaded == [adapter(2, pinned=True, replaces=1)]
    assert not sched.slots.is_pinned(1) and sched.slots.is_pinned(2)
    assert sched.slots.num_pinned == 1


def test_an_unpinned_reload_unpins_the_old_id():
    sched = make_scheduler(num_slots=2)
    load(sched, 1, pinned=True)
    sched.load_adapters(LoadAdapters(op_id=1, adapters=[adapter(2, replaces=1)]), now=0.0)
    sched.add_adapter_report(report(1, 0, ok(2)))
    assert not sched.slots.is_pinned(1) and not sched.slots.is_pinned(2)


def test_drop_of_an_unknown_id_is_not_found():
    sched = make_scheduler()
    load(sched, 1)
    reply, deltas = sched.drop_adapters(DropAdapters(op_id=3, lora_ids=[9, 1]))
    assert reply.op_id == 3 and deltas == []
    missing, dropped = reply.outcomes
    assert not missing.success and missing.lora_id == 9 and missing.error_kind == "not_found"
    assert "9" in missing.error_message
    assert dropped == AdapterOutcome(lora_id=1, success=True)
    assert not sched.adapters.is_loaded(1)
    reply, _ = sched.drop_adapters(DropAdapters(op_id=4, lora_ids=[1]))  # twice: gone already
    assert reply.outcomes[0].error_kind == "not_found"


def test_drop_while_a_pass_is_in_flight_raises():
    sched = make_scheduler()
    load(sched, 1)
    sched.add_request(gen("a"))
    sched.schedule()
    with pytest.raises(RuntimeError):
        sched.drop_adapters(DropAdapters(op_id=1, lora_ids=[1]))


def test_drop_empties_the_slot_and_fails_waiting_requests():
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
    reply, deltas = sched.drop_adapters(DropAdapters(op_id=5, lora_ids=[1, 9]))
    assert [o.success for o in reply.outcomes] == [True, False]
    assert reply.outcomes[1].error_kind == "not_found"
    assert [(d.rid, d.finish_reason) for d in deltas] == [("c", "error")]
    assert "adapter id 1 was unloaded" in deltas[0].error_message
    assert sched.slots.slot_table() == [-1, 2] and not sched.adapters.is_loaded(1)
    workers.record(sched.add_request(gen("d", lora=1)))  # not loaded any more
    assert workers.finished["d"].finish_reason == "error"
    workers.run_until_idle()
    reply, _ = sched.drop_adapters(DropAdapters(op_id=6, lora_ids=[2]))
    assert reply.outcomes[0].success and not sched.slots.is_pinned(2) and sched.slots.slot_table() == [-1, -1]
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
        prefix_cache=rng.random() < 0.5,
        long_rope_len=rng.choice([0, 10]),  # longrope: requests that grow past 10 are recomputed
        attention_window=rng.choice([None, 5, 9]),  # a sliding-window model gives pages back as it goes
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
