"""A hybrid model's prefix cache on plain ints: state snapshots kept at cached page boundaries. Random traffic over
shared system prompts (admissions, chunked prefill, preemptions, finishes, aborts, prefix hits, an adapter unloaded
and its pages purged, two passes in flight) is played against workers that keep, per state slot and per snapshot,
whose state it is and of which tokens. Checked at every pass: a hit restores a snapshot saved at exactly its
boundary, of the same tokens and adapter, by a pass that has returned; a pass saves only at a page boundary it
crosses, into a snapshot no page holds; a request's state is its own and at its position; and after every step each
snapshot is free, kept by one cached page, or being saved by a pass in flight. At the end nothing leaked."""

from __future__ import annotations

import random

import pytest
from loraplex.protocol.structs import DropAdapters, SamplingParams, TokenizedGenerateReq

from tests.scheduler_helpers import cached_namespaces, kept_snapshots, saving_snapshots
from tests.unit.test_engine_core import OverlapWorkers
from tests.unit.test_scheduler_core import Workers, assert_drained, load, make_scheduler
from tests.unit.test_state_slots import StateChecks, state_token

PAGE = 4
SYSTEM_PROMPTS = [list(range(1000, 1011)), list(range(2000, 2014))]  # 11 and 14 tokens: 2 and 3 full pages


def namespace(req) -> int:
    return -1 if req.lora_id is None else req.lora_id


class SnapshotChecks(StateChecks):
    def init_states(self) -> None:
        super().init_states()
        self.snapshots: dict[int, tuple[int, tuple[int, ...], int]] = {}  # -> (namespace, tokens, saving batch)
        self.num_restores = 0
        self.num_restores_after_preemption = 0

    def check_states(self, batch, reqs) -> None:
        sched = self.sched
        kept = set(kept_snapshots(sched.cache).values())
        for req, fwd in zip(reqs, batch.reqs, strict=True):
            if fwd.restore_snapshot >= 0:
                assert fwd.num_cached_tokens > 0 and fwd.restore_snapshot in kept
                space, tokens, saved_by = self.snapshots[fwd.restore_snapshot]
                assert not sched.is_in_flight(saved_by), f"{req.rid} restores a snapshot its pass is still saving"
                assert (space, tokens) == (namespace(req), tuple(req.token_ids[: fwd.num_cached_tokens])), \
                    f"{req.rid} restores a snapshot of other tokens or another adapter"  # fmt: skip
                self.states[fwd.state_slot] = (fwd.req_key, fwd.num_cached_tokens)  # the worker copies it in
                self.num_restores += 1
                self.num_restores_after_preemption += req.num_preemptions > 0
        super().check_states(batch, reqs)  # the state of every other pass is the request's own, at its position
        for req, fwd in zip(reqs, batch.reqs, strict=True):
            for position, snapshot in fwd.snapshot_saves:
                assert position % PAGE == 0 and fwd.num_cached_tokens < position
                assert position <= fwd.num_cached_tokens + len(fwd.input_ids) and position <= req.num_tokens
                assert snapshot not in kept, f"{req.rid} overwrites a snapshot a cached page holds"
                self.snapshots[snapshot] = (namespace(req), tuple(req.token_ids[:position]), batch.batch_id)

    def check_snapshots(self) -> None:
        sched = self.sched
        kept, saving = list(kept_snapshots(sched.cache).values()), saving_snapshots(sched)
        assert len(set(kept + saving)) == len(kept) + len(saving), "a snapshot held twice"
        assert sched.snapshots.num_free + len(kept) + len(saving) == sched.snapshots.num_slots, "a snapshot leaked"


class SnapshotWorkers(SnapshotChecks, Workers):
    def __init__(self, sched, next_token):
        super().__init__(sched, next_token)
        self.init_states()

    def check_batch(self, batch, reqs) -> None:
        super().check_batch(batch, reqs)
        self.check_states(batch, reqs)

    def step(self, error_message: str = ""):
        batch = super().step(error_message)
        self.check_slots()
        self.check_snapshots()
        return batch


class OverlapSnapshotWorkers(SnapshotChecks, OverlapWorkers):
    def __init__(self, sched, next_token):
        super().__init__(sched, next_token)
        self.init_states()

    def keep_state(self, batch, reqs) -> None:
        super().keep_state(batch, reqs)
        self.check_states(batch, reqs)

    def step(self, error_message: str = ""):
        batch = super().step(error_message)
        self.check_slots()
        self.check_snapshots()
        return batch


def request(rid: str, prompt: list[int], max_new: int, lora: int | None) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling=SamplingParams(max_new_tokens=max_new),
                                lora_id=lora)  # fmt: skip


def random_traffic(rng: random.Random, num_steps: int, max_new: int = 8) -> list[tuple]:
    """(step, rid, prompt, max_new, lora, abort): a system prompt and a tail, or an earlier prompt grown (a later
    turn), under the base model or adapter 0 or 1."""
    traffic = []
    for step in range(num_steps):
        for _ in range(rng.randint(0, 2)):
            if traffic and rng.random() < 0.25:
                _, _, earlier, _, lora, _ = rng.choice(traffic)
                prompt = earlier + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
            else:
                lora = rng.choice([None, 0, 1])
                prompt = rng.choice(SYSTEM_PROMPTS) + [rng.randrange(50) for _ in range(rng.randint(0, 7))]
            traffic.append((step, f"r{len(traffic)}", prompt[:40], rng.randint(1, max_new), lora, rng.random() < 0.1))
    return traffic


def play(traffic, workers_type, *, num_steps: int, aborts: bool = False, drop_at: int | None = None, **options):
    """Run the traffic to the end; drop_at: adapter 1 is unloaded at that step (after the passes in flight return)
    and its later requests use adapter 2. Returns the scheduler, the workers and the outputs of requests that ran
    to their length."""
    sched = make_scheduler(page_size=PAGE, num_slots=2, context_length=64, prefix_cache=True, **options)
    load(sched, 0, 1)
    workers = workers_type(sched, state_token)
    dropped, aborted = False, set()
    for step in range(num_steps):
        if step == drop_at:
            while sched.has_batch_in_flight:
                workers.step()
            pages_before = sched.cache.num_cached
            _, deltas = sched.drop_adapters(DropAdapters(op_id=1, lora_ids=[1]))
            workers.record(deltas)
            assert 1 not in cached_namespaces(sched.cache) and sched.cache.num_cached <= pages_before
            workers.check_snapshots()
            load(sched, 2)
            dropped = True
        for _, rid, prompt, max_new, lora, abort in [t for t in traffic if t[0] == step]:
            lora = 2 if dropped and lora == 1 else lora
            workers.record(sched.add_request(request(rid, prompt, max_new, lora)))
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
    lengths = {rid for rid, delta in workers.finished.items() if delta.finish_reason == "length"}
    return sched, workers, {rid: out for rid, out in workers.outputs.items() if rid in lengths}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_with_state_snapshots(seed, overlap):
    rng = random.Random(seed)
    traffic = random_traffic(rng, 40)
    _, _, reference = play(traffic, SnapshotWorkers, num_steps=40, num_pages=400, max_running=64,
                           num_state_slots=64)  # no snapshots: no prefix cache  # fmt: skip
    num_slots = rng.randint(2, 6)
    sched, workers, outputs = play(
        traffic, OverlapSnapshotWorkers if overlap else SnapshotWorkers, num_steps=40, aborts=True,
        num_pages=rng.randint(14, 30), max_running=rng.randint(2, 8), num_state_slots=num_slots,
        num_state_snapshots=rng.randint(num_slots + 2, 3 * num_slots),
        chunked_prefill_size=rng.choice([-1, 3, 5, 12]), max_prefill=64,
    )  # fmt: skip
    assert outputs == {rid: out for rid, out in reference.items() if rid in outputs}
    assert len(outputs) >= len(traffic) // 2
    assert workers.num_restores > 0 and sched.cache.num_hit_tokens > 0


def test_random_traffic_restores_after_preemptions_and_survives_an_adapter_purge():
    num_preemptions = num_restores_after_preemption = 0
    for seed in range(6):
        rng = random.Random(100 + seed)
        traffic = random_traffic(rng, 40, max_new=16)
        sched, workers, _ = play(traffic, SnapshotWorkers, num_steps=40, drop_at=20, num_pages=12, max_running=6,
                                 num_state_slots=4, num_state_snapshots=6, chunked_prefill_size=5)  # fmt: skip
        num_preemptions += sched.num_preemptions
        num_restores_after_preemption += workers.num_restores_after_preemption
    assert num_preemptions > 0 and num_restores_after_preemption > 0


def test_a_shared_system_prompt_hits_on_its_third_request():
    # The first request saves its prompt's last full page (12, inside its own tail); the second matches the system
    # prompt's pages (8) by KV but no snapshot, so it computes them again and saves 8; the third restores 8.
    sched = make_scheduler(page_size=PAGE, prefix_cache=True, num_state_slots=2, num_state_snapshots=4)
    workers = SnapshotWorkers(sched, state_token)
    system = SYSTEM_PROMPTS[0]  # 11 tokens
    passes = []
    for rid, tail in (("a", [1, 2, 3]), ("b", [4, 5]), ("c", [6])):
        sched.add_request(request(rid, system + tail, 2, None))
        passes.append(workers.step().reqs[0])
        workers.run_until_idle()
    assert [(p.num_cached_tokens, p.restore_snapshot >= 0, [s[0] for s in p.snapshot_saves]) for p in passes] == [
        (0, False, [12]), (0, False, [8, 12]), (8, True, [12])]  # fmt: skip
    assert workers.deltas["c"][0].num_cached_prompt_tokens == 8 and sched.cache.num_hit_tokens == 8
    assert_drained(sched)


def test_snapshots_run_short_take_the_least_recently_used_page_s():
    sched = make_scheduler(page_size=PAGE, prefix_cache=True, num_state_slots=2, num_state_snapshots=1)
    workers = SnapshotWorkers(sched, state_token)
    for rid, prompt in (("a", SYSTEM_PROMPTS[0] + [1]), ("b", SYSTEM_PROMPTS[1] + [2])):
        sched.add_request(request(rid, prompt, 1, None))
        workers.run_until_idle()
    # b's save took a's snapshot (a's pages stay cached): a repeat of b hits, one of a finds KV but no snapshot
    assert len(kept_snapshots(sched.cache)) == 1
    for rid, prompt, hit in (("b2", SYSTEM_PROMPTS[1] + [4], 12), ("a2", SYSTEM_PROMPTS[0] + [3], 0)):
        sched.add_request(request(rid, prompt, 1, None))
        workers.run_until_idle()
        assert workers.deltas[rid][0].num_cached_prompt_tokens == hit
    assert_drained(sched)
