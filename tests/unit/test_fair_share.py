"""FairShare (virtual token counters) on plain ints: the bound its docstring states holds for backlogged clients at any
rates, and fails without the policy (first come, first served) or without the lift of a newly active client."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from loraplex.scheduler.fair_share import OUTPUT_WEIGHT, PROMPT_WEIGHT, FairShare

CAPACITY = 4  # requests running at once, all of one client's at worst (R in the bound)
MAX_PROMPT, MAX_OUTPUT = 8, 6  # L and M in the bound
BOUND = CAPACITY * (PROMPT_WEIGHT * MAX_PROMPT + OUTPUT_WEIGHT * MAX_OUTPUT)


@dataclass
class Req:
    client: str
    prompt_len: int
    num_left: int  # output tokens still to come


class Sim:
    """Admission by a FairShare's order (or arrival order), CAPACITY running, one output token per running request per
    step; records each client's counter after every step."""

    def __init__(self, seed: int, *, fair: bool = True):
        self.rng = random.Random(seed)
        self.share = FairShare()
        self.fair = fair
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.history: list[dict[str, int]] = []

    def step(self, arrivals: dict[str, int]) -> None:
        share = self.share
        for client, num in arrivals.items():
            for _ in range(num):
                self.waiting.append(Req(client, self.rng.randint(1, MAX_PROMPT), self.rng.randint(1, MAX_OUTPUT)))
                share.join(client)
        order = self.waiting
        if self.fair:
            order = share.order(self.waiting, lambda r: r.client, lambda r: PROMPT_WEIGHT * r.prompt_len)
        admitted = order[: CAPACITY - len(self.running)]
        for req in admitted:
            share.leave(req.client)
            share.charge(req.client, PROMPT_WEIGHT * req.prompt_len)
        taken = {id(r) for r in admitted}
        self.waiting = [r for r in self.waiting if id(r) not in taken]
        self.running += admitted
        for req in self.running:
            share.charge(req.client, OUTPUT_WEIGHT)
            req.num_left -= 1
        self.running = [r for r in self.running if r.num_left]
        self.history.append({c: share.counter(c) for c in ("hot", "cold")})

    def max_gap(self, start: int = 0) -> int:
        return max(abs(h["hot"] - h["cold"]) for h in self.history[start:])

    def max_service_gap(self, start: int = 0) -> int:
        """The largest difference of the two clients' service over any interval from step `start` on."""
        diffs = [h["hot"] - h["cold"] for h in self.history[start:]]
        return max(diffs) - min(diffs)


@pytest.mark.parametrize("seed", range(5))
def test_a_hot_client_at_ten_times_the_rate_stays_within_the_bound(seed):
    sim = Sim(seed)
    for _ in range(300):
        sim.step({"hot": 10, "cold": 1})  # both stay backlogged: about one request finishes per step
    assert sim.share.num_backlogged == 2
    assert sim.max_gap() <= BOUND
    assert sim.max_service_gap() <= 2 * BOUND


def test_first_come_first_served_breaks_the_bound():
    # The control: the same stream in arrival order gives the hot client ten times the service.
    sim = Sim(0, fair=False)
    for _ in range(300):
        sim.step({"hot": 10, "cold": 1})
    assert sim.max_gap() > 5 * BOUND


def _idle_then_burst(sim: Sim) -> None:
    for _ in range(200):
        sim.step({"hot": 3})  # cold idle: hot alone, backlogged
    sim.step({"hot": 3, "cold": 200})  # cold wakes with a burst
    for _ in range(200):
        sim.step({"hot": 3})


def test_an_idle_client_banks_no_credit():
    sim = Sim(1)
    _idle_then_burst(sim)
    assert sim.history[199]["cold"] == 0 and sim.history[199]["hot"] > 10 * BOUND
    assert sim.max_gap(start=200) <= BOUND  # lifted to hot's counter when it joined


def test_without_the_lift_the_idle_client_would_take_everything(monkeypatch):
    def join_without_lift(self, client):
        self._num_waiting[client] = self._num_waiting.get(client, 0) + 1

    monkeypatch.setattr(FairShare, "join", join_without_lift)
    sim = Sim(1)
    _idle_then_burst(sim)
    assert sim.max_gap(start=200) > 5 * BOUND


def test_order_interleaves_by_counter_plus_the_costs_ordered_before():
    share = FairShare()
    for client in "aab" + "bbb":
        share.join(client)
    share.charge("a", 3)
    # (client, cost) in arrival order; a starts 3 ahead.
    waiting = [("a", 2), ("a", 2), ("b", 5), ("b", 1), ("b", 1), ("b", 1)]
    order = share.order(waiting, lambda r: r[0], lambda r: r[1])
    # b at 0 -> b0 (b: 5); a at 3 -> a0 (a: 5); a older head at the 5-5 tie? b's head index 3 > a's 1: a1 (a: 7);
    # b at 5 -> b1 (6), b2 (7); tie at 7: a has nothing left -> b3.
    assert order == [waiting[i] for i in (2, 0, 1, 3, 4, 5)]


def test_join_lifts_to_the_least_backlogged_counter_or_the_last_to_leave():
    share = FairShare()
    share.join("a")
    share.join("b")
    share.charge("a", 10)
    share.charge("b", 4)
    share.join("c")
    assert share.counter("c") == 4  # the least of the backlog
    share.charge("c", 100)
    for client in "abc":
        share.leave(client)
    assert share.num_backlogged == 0
    share.join("d")
    assert share.counter("d") == 104  # nobody backlogged: the last to leave (c)
    share.join("a")
    assert share.counter("a") == 104  # a's own counter was lower: lifted
    share.leave("d")
    share.leave("a")
    share.forget(lambda client: client in ("a", "b"))
    assert share.counter("a") == 0 and share.counter("c") == 104
