"""A hybrid model's state slots in the scheduler, on plain ints: the allocator, and random traffic (admissions, chunks,
preemptions, finishes, aborts, two passes in flight) played against workers that keep a state per slot, checking
each pass: a request's state is its own and at its position (never another request's, never stale after a
preemption), and a running request holds a slot exactly while it holds pages; at the end nothing leaked. Without
state snapshots there is no prefix caching (test_state_snapshots.py has it)."""

from __future__ import annotations

import random

import pytest
from loraplex.scheduler.state_slots import StateSlotAllocator, StateSlotError

from tests.scheduler_helpers import in_flight_requests
from tests.unit.test_engine_core import OverlapWorkers
from tests.unit.test_scheduler_core import Workers, assert_drained, gen, load, make_scheduler


def test_allocator_hands_out_low_slots_first_and_refuses_bad_frees():
    slots = StateSlotAllocator(3)
    assert [slots.allocate() for _ in range(3)] == [0, 1, 2]
    assert not slots.can_allocate()
    with pytest.raises(StateSlotError):
        slots.allocate()
    slots.free(1)
    assert slots.num_free == 1 and slots.allocate() == 1
    slots.free(2)
    with pytest.raises(StateSlotError, match="twice"):
        slots.free(2)
    with pytest.raises(StateSlotError):
        slots.free(3)


def test_a_plain_model_sends_no_state_slot_and_a_hybrid_one_without_snapshots_disables_the_prefix_cache():
    plain = make_scheduler(prefix_cache=True)
    assert plain.cache.enabled and plain.state_slots.num_slots == 0
    assert make_scheduler(prefix_cache=True, num_state_slots=4, num_state_snapshots=4).cache.enabled
    hybrid = make_scheduler(prefix_cache=True, num_state_slots=4)
    assert not hybrid.cache.enabled
    hybrid.add_request(gen("a", prompt_len=6, max_new=2))
    batch = hybrid.schedule()
    assert batch.reqs[0].state_slot == 0
    assert plain.add_request(gen("a")) == [] and plain.schedule().reqs[0].state_slot == -1


def test_admission_waits_for_a_free_state_slot():
    sched = make_scheduler(max_running=8, num_state_slots=2)
    workers = Workers(sched)
    for rid in "abc":
        sched.add_request(gen(rid, prompt_len=4, max_new=3))
    workers.step()
    assert len(sched.running) == 2 and sched.state_slots.num_free == 0
    workers.run_until_idle()
    assert set(workers.finished) == {"a", "b", "c"}
    assert_drained(sched)


def state_token(rid: str, fwd) -> int:
    return 100 + fwd.num_cached_tokens + len(fwd.input_ids)


class StateChecks:
    """Mixed into the fake workers: keeps (owner, position) per state slot as a worker's state would be."""

    def init_states(self) -> None:
        self.states: dict[int, tuple[int, int]] = {}  # slot -> (req_key, tokens folded into the state)

    def check_states(self, batch, reqs) -> None:
        sched = self.sched
        slots = [fwd.state_slot for fwd in batch.reqs]
        assert len(set(slots)) == len(slots) and all(0 <= s < sched.state_slots.num_slots for s in slots)
        for req, fwd in zip(reqs, batch.reqs, strict=True):
            assert fwd.state_slot == req.state_slot
            if fwd.num_cached_tokens == 0:
                self.states[fwd.state_slot] = (fwd.req_key, 0)  # the worker zeroes it
            owner, position = self.states[fwd.state_slot]
            assert owner == fwd.req_key, f"{req.rid} would read request {owner}'s state"
            assert position == fwd.num_cached_tokens, f"{req.rid}'s state is at {position}, its pass at " \
                                                      f"{fwd.num_cached_tokens}"  # fmt: skip
            self.states[fwd.state_slot] = (owner, position + len(fwd.input_ids))

    def check_slots(self) -> None:
        sched = self.sched
        held = [r.state_slot for r in sched.running.values() if r.state_slot != -1]
        assert len(set(held)) == len(held)
        assert all((r.state_slot != -1) == bool(r.live_page_ids) for r in sched.running.values()
                   if r.num_scheduled_tokens)  # fmt: skip
        assert all(r.state_slot == -1 and not r.page_ids for r in sched.waiting.values())
        # finished requests whose last pass is in flight still hold theirs
        in_flight = {r.state_slot for r in in_flight_requests(sched)} if sched.has_batch_in_flight else set()
        assert sched.state_slots.num_free + len(set(held) | (in_flight - {-1})) == sched.state_slots.num_slots


class StateWorkers(StateChecks, Workers):
    def __init__(self, sched, next_token):
        super().__init__(sched, next_token)
        self.init_states()

    def check_batch(self, batch, reqs) -> None:
        super().check_batch(batch, reqs)
        self.check_states(batch, reqs)

    def step(self, error_message: str = ""):
        batch = super().step(error_message)
        self.check_slots()
        return batch


class OverlapStateWorkers(StateChecks, OverlapWorkers):
    def __init__(self, sched, next_token):
        super().__init__(sched, next_token)
        self.init_states()

    def keep_state(self, batch, reqs) -> None:
        super().keep_state(batch, reqs)
        self.check_states(batch, reqs)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", range(10))
def test_random_traffic_with_state_slots(seed, overlap):
    rng = random.Random(seed)
    traffic = []
    for step in range(40):
        for _ in range(rng.randint(0, 2)):
            traffic.append((step, f"r{len(traffic)}", rng.randint(1, 20), rng.randint(1, 16),
                            rng.choice([None, 0, 1]), rng.random() < 0.15))  # fmt: skip

    def run(workers_type, aborts: bool, **options):
        sched = make_scheduler(page_size=4, num_slots=2, context_length=64, prefix_cache=True, **options)
        load(sched, 0, 1)
        workers = workers_type(sched, state_token)
        aborted = set()
        for step in range(40):
            for _, rid, prompt_len, max_new, lora, abort in [t for t in traffic if t[0] == step]:
                workers.record(sched.add_request(gen(rid, prompt_len=prompt_len, max_new=max_new, lora=lora)))
                if abort and aborts:
                    aborted.add(rid)
            if step % 3 == 0:  # aborts land between steps, waiting or running
                for rid in sorted(aborted):
                    workers.record(sched.abort(rid))
                aborted.clear()
            workers.step()
        for _ in range(10_000):
            if workers.step() is None:
                break
        assert_drained(sched)
        assert sched.cache.num_hit_tokens == 0
        return {rid: out for rid, out in workers.outputs.items() if workers.finished[rid].finish_reason != "abort"}, \
            sched.num_preemptions  # fmt: skip

    reference, _ = run(StateWorkers, False, num_pages=400, max_running=64, num_state_slots=64)
    num_slots = rng.randint(2, 6)
    pressured, num_preemptions = run(
        OverlapStateWorkers if overlap else StateWorkers, True,
        num_pages=rng.randint(10, 20), max_running=rng.randint(2, 8), num_state_slots=num_slots,
        chunked_prefill_size=rng.randint(3, 12), max_prefill=64,
    )  # fmt: skip
    assert pressured == {rid: out for rid, out in reference.items() if rid in pressured}
    assert len(pressured) >= len(traffic) // 2


def test_random_traffic_preempts():
    """The pressured runs above do preempt: a fixed case that must."""
    sched = make_scheduler(page_size=4, num_pages=6, max_running=4, num_state_slots=4, chunked_prefill_size=4)
    workers = StateWorkers(sched, state_token)
    for rid in "abcd":
        sched.add_request(gen(rid, prompt_len=3, max_new=8))
    workers.run_until_idle()
    assert sched.num_preemptions > 0 and len(workers.finished) == 4
    assert_drained(sched)
