"""The scheduler's admission order: fair share between adapters (and API keys), --max-running-per-adapter, and
--scheduling-policy priority, driven through the Scheduler as the process drives it."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import SamplingParams, TokenizedGenerateReq
from loraplex.scheduler.fair_share import OUTPUT_WEIGHT, PROMPT_WEIGHT
from loraplex.scheduler.scheduler import Scheduler

from tests.unit.test_scheduler_core import TOKEN, Workers, assert_drained, load


def make(*, num_pages=256, max_running=4, num_slots=4, **settings) -> Scheduler:
    config = ServerConfig(page_size=4, max_loras_per_batch=num_slots, max_running_requests=max_running,
                          disable_radix_cache=True, **settings)
    return Scheduler(config, num_pages=num_pages, context_length=512, chunked_prefill_size=-1)


def gen(rid: str, *, lora: int | None = None, prompt_len=4, max_new=4, priority=0, key: str | None = None,
        stop: tuple[int, ...] = ()):
    sampling = SamplingParams(max_new_tokens=max_new, stop_token_ids=list(stop))
    return TokenizedGenerateReq(rid=rid, input_ids=list(range(1, prompt_len + 1)), sampling=sampling, lora_id=lora,
                                priority=priority, key_id=key)


def first_admitted(sched: Scheduler, workers: Workers) -> dict[str, int]:
    workers.run_until_idle()
    assert_drained(sched)
    return workers.prefilled_at


@pytest.mark.parametrize("is_fair", [True, False])
def test_a_burst_on_one_adapter_does_not_make_another_wait_behind_it(is_fair):
    sched = make(disable_adapter_fairness=not is_fair)
    load(sched, 1, 2)
    workers = Workers(sched)
    for i in range(40):
        sched.add_request(gen(f"hot{i}", lora=1))
    workers.step()
    sched.add_request(gen("cold", lora=2))
    at = first_admitted(sched, workers)
    hot_before = sum(1 for rid, step in at.items() if rid.startswith("hot") and step < at["cold"])
    if is_fair:
        assert hot_before == 4  # only the first step's, which ran before cold arrived
    else:
        assert hot_before == 40  # the control: first come, first served puts it behind the whole burst


def test_fair_share_is_per_api_key_too():
    sched = make(max_running=2)
    workers = Workers(sched)
    for i in range(20):
        sched.add_request(gen(f"k1-{i}", key="key1"))
    workers.step()
    sched.add_request(gen("k2", key="key2"))
    at = first_admitted(sched, workers)
    assert sum(1 for rid, step in at.items() if rid.startswith("k1") and step < at["k2"]) == 2


def test_counters_charge_prompt_once_and_outputs_even_across_preemptions():
    sched = make(num_pages=3, max_running=4)  # 12 tokens: preemptions
    load(sched, 1)
    workers = Workers(sched)
    sched.add_request(gen("a", lora=1, prompt_len=4, max_new=8))
    sched.add_request(gen("b", prompt_len=4, max_new=8))
    workers.run_until_idle()
    assert sched.num_preemptions >= 1
    share = sched.order.share
    assert share.counter((None, 1)) == share.counter((None, None)) == PROMPT_WEIGHT * 4 + OUTPUT_WEIGHT * 8
    assert_drained(sched)
    assert sched.order.num_backlogged == 0


def test_max_running_per_adapter():
    sched = make(max_running=8, max_running_per_adapter=2)
    load(sched, 1, 2)
    workers = Workers(sched)
    for i in range(6):
        sched.add_request(gen(f"a{i}", lora=1, max_new=3))
        sched.add_request(gen(f"b{i}", lora=2, max_new=3))
        sched.add_request(gen(f"base{i}", max_new=3))
    most = Counter()
    while workers.step() is not None:
        running = Counter(r.lora_id for r in sched.running.values())
        most = Counter({k: max(most[k], running[k]) for k in {*most, *running}})
    assert most[1] == most[2] == 2 and most[None] > 2  # the base model is no adapter: not capped
    assert len(workers.finished) == 18
    assert_drained(sched)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_priority_policy_orders_waiting_requests_by_priority_then_arrival(policy):
    sched = make(max_running=1, scheduling_policy=policy, disable_adapter_fairness=True)
    workers = Workers(sched)
    for rid, priority in [("p5", 5), ("p0", 0), ("m1a", -1), ("p0b", 0), ("m1b", -1)]:
        sched.add_request(gen(rid, priority=priority, max_new=1))
    at = first_admitted(sched, workers)
    order = sorted(at, key=at.get)
    assert order == (["m1a", "m1b", "p0", "p0b", "p5"] if policy == "priority" else ["p5", "p0", "m1a", "p0b", "m1b"])


def test_priority_with_fair_share_within_a_level():
    sched = make(max_running=1, scheduling_policy="priority")
    load(sched, 1, 2)
    workers = Workers(sched)
    for i in range(3):
        sched.add_request(gen(f"a{i}", lora=1, max_new=1, priority=1))
    sched.add_request(gen("b0", lora=2, max_new=1, priority=1))
    sched.add_request(gen("urgent", lora=1, max_new=1, priority=0))
    at = first_admitted(sched, workers)
    order = sorted(at, key=at.get)
    assert order[0] == "urgent" and order.index("b0") < order.index("a1")


def test_priority_policy_preempts_the_lowest_priority_first():
    sched = make(num_pages=4, max_running=4, scheduling_policy="priority")
    workers = Workers(sched)
    sched.add_request(gen("low", priority=9, max_new=8))
    sched.add_request(gen("high", priority=0, max_new=8))  # newer, but more urgent
    sched.add_request(gen("mid", priority=3, max_new=8))
    workers.step()
    preempted = []
    while workers.step() is not None:
        preempted += [r.rid for r in sched.waiting.values() if r.num_preemptions and r.rid not in preempted]
    assert preempted and preempted[0] == "low" and "high" not in preempted
    assert_drained(sched)


@pytest.mark.parametrize("seed", range(10))
def test_random_traffic_with_every_option_keeps_every_invariant(seed):
    rng = random.Random(seed)
    sched = make(num_pages=rng.randint(6, 40), max_running=rng.randint(1, 6), num_slots=rng.randint(1, 3),
                 max_running_per_adapter=rng.choice([None, 1, 2]), scheduling_policy=rng.choice(["fcfs", "priority"]),
                 disable_adapter_fairness=rng.random() < 0.3)
    load(sched, *range(5))
    workers = Workers(sched, lambda rid, fwd: rng.choice([TOKEN] * 9 + [2]))
    rids = []
    for _ in range(60):
        for _ in range(rng.randint(0, 3)):
            rids.append(f"r{len(rids)}")
            workers.record(sched.add_request(gen(
                rids[-1], lora=rng.choice([None, *range(5)]), prompt_len=rng.randint(1, 12),
                max_new=rng.randint(1, 10), priority=rng.randint(-2, 2), key=rng.choice([None, "k1", "k2"]),
                stop=(2,))))
        if rids and rng.random() < 0.1:
            workers.record(sched.abort(rng.choice(rids)))
        workers.step()
    workers.run_until_idle()
    assert set(workers.finished) == set(rids)
    assert_drained(sched)
    assert sched.order.num_backlogged == 0
