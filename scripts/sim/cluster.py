"""Cluster simulator core: N replicas, each running the real torch-free `Scheduler`, behind a routing policy
(scripts/sim/policies.py).

A discrete-event simulation. Requests arrive open-loop (Poisson) with adapters drawn from a Zipf law; the router
picks a replica; the replica's Scheduler batches them exactly as the server does (continuous batching, KV pages,
chunked prefill, adapter device slots with LRU and the no-starvation rule). Only the forward pass is not run: its
duration comes from a step-cost model (`StepCost`, calibrated by scripts/sim/calibrate.py or given as GPU figures),
and it "samples" a fixed token, so requests end at their max_new_tokens.

Assumptions (what the model leaves out): one forward pass in flight per replica (the server overlaps two, hiding the
scheduler's own time); the router sees each replica's state at once (a gateway scrapes it every few tens of ms);
host memory holds every adapter a replica has read (the first request for an adapter on a replica waits
`host_load_s` for the disk read, off the decode loop); no prefix cache (random prompts share nothing).
scripts/sim/simulate.py sweeps it and draws the table and plot.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass, field

from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import (
    AdapterOutcome,
    AdapterReport,
    AdapterToLoad,
    BatchResult,
    ForwardBatch,
    LoadAdapters,
    SamplingParams,
    TokenizedGenerateReq,
)
from loraplex.scheduler.scheduler import Scheduler

from scripts.sim.policies import POLICIES

TOKEN = 7  # what every simulated pass samples; never a stop token, so requests run to max_new_tokens


@dataclass(frozen=True)
class StepCost:
    """Seconds one forward pass takes: a fixed part, each token, each distinct adapter (one LoRA segment per adapter),
    and each adapter copied into a device slot; and the disk read of an adapter. Defaults: this repository's CPU
    figures (docs/BENCHMARKS.md: the 137 M bench model in bfloat16 on 2 cores, rank-16 adapters on all seven
    modules): a decode step of 1 request 13.74 ms and of 32 requests 33.4 ms (so 13.1 ms + 0.634 ms a token),
    37.8 ms over 8 adapters (0.55 ms an adapter), an idle adapter load 6.1 ms. Two are estimates: a prefill token at
    0.45 ms (the bench model's prefill-token / decode-row ratio in HF, 0.4, applied to ours) and a slot copy of ~7 MB
    at 1 ms."""

    base_s: float = 0.0131
    decode_token_s: float = 0.000634
    prefill_token_s: float = 0.00045
    adapter_s: float = 0.00055
    slot_load_s: float = 0.001
    host_load_s: float = 0.0061

    def of(self, batch: ForwardBatch) -> float:
        num_decode = sum(1 for r in batch.reqs if len(r.input_ids) == 1)
        num_prefill = sum(len(r.input_ids) for r in batch.reqs if len(r.input_ids) > 1)
        num_adapters = len({r.slot for r in batch.reqs if r.slot >= 0})
        return (self.base_s + self.decode_token_s * num_decode + self.prefill_token_s * num_prefill
                + self.adapter_s * num_adapters + self.slot_load_s * len(batch.slot_loads))  # fmt: skip


@dataclass(frozen=True)
class ReplicaShape:
    """One replica's limits, as its launch flags would set them."""

    num_slots: int = 8  # --max-loras-per-batch
    max_running: int = 32  # --max-running-requests
    num_pages: int = 2048  # KV cache pages of page_size tokens
    page_size: int = 16
    chunked_prefill_size: int = 512
    context_length: int = 4096


@dataclass(frozen=True)
class SimRequest:
    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    adapter: int | None  # 1..num_adapters by popularity rank; None = base model


@dataclass(frozen=True)
class Workload:
    """Open-loop Poisson arrivals; adapter k (1 = most popular) with probability proportional to 1 / k**zipf_s."""

    num_requests: int
    rate_per_s: float
    num_adapters: int
    zipf_s: float = 1.0
    base_share: float = 0.0
    prompt_len: tuple[int, int] = (32, 256)
    output_len: tuple[int, int] = (16, 128)
    seed: int = 0

    def requests(self) -> list[SimRequest]:
        rng = random.Random(self.seed)
        weights = [1 / k**self.zipf_s for k in range(1, self.num_adapters + 1)]
        cumulative = list(_accumulate(weights))
        now, out = 0.0, []
        for i in range(self.num_requests):
            now += rng.expovariate(self.rate_per_s)
            is_base = self.num_adapters == 0 or rng.random() < self.base_share
            adapter = None if is_base else rng.choices(range(1, self.num_adapters + 1), cum_weights=cumulative)[0]
            out.append(SimRequest(i, now, rng.randint(*self.prompt_len), rng.randint(*self.output_len), adapter))
        return out


class Replica:
    """One simulated server: the real Scheduler, the adapters its host memory holds, the pass it is running."""

    def __init__(self, index: int, shape: ReplicaShape):
        self.index = index
        self.shape = shape
        config = ServerConfig(max_loras_per_batch=shape.num_slots, max_running_requests=shape.max_running,
                              page_size=shape.page_size, disable_radix_cache=True)  # fmt: skip
        self.scheduler = Scheduler(config, num_pages=shape.num_pages, context_length=shape.context_length,
                                   chunked_prefill_size=shape.chunked_prefill_size)  # fmt: skip
        self.in_host: set[int] = set()
        self.reading: dict[int, int] = {}  # adapter -> requests waiting for its disk read
        self.busy = False  # a forward pass is running
        self.sent_slot_table = self.scheduler.slots.slot_table()  # what the router last heard (scheduler/process.py)
        self.num_slot_loads = 0
        self.num_host_loads = 0
        self._next_op = 0

    # ---- what a router sees

    @property
    def load(self) -> int:
        """Requests running, waiting, or waiting for their adapter's disk read (the gateways' queue + running)."""
        return len(self.scheduler.running) + len(self.scheduler.waiting) + sum(self.reading.values())

    def is_resident(self, adapter: int) -> bool:
        return self.scheduler.slots.is_resident(adapter)

    def running_adapters(self) -> set[int]:
        return {r.lora_id for r in self.scheduler.running.values() if r.lora_id is not None}

    def waiting_adapters(self) -> set[int]:
        return {r.lora_id for r in self.scheduler.waiting.values() if r.lora_id is not None} | set(self.reading)

    @property
    def kv_usage(self) -> float:
        return self.scheduler.cache.num_in_use / self.shape.num_pages

    # ---- what the simulation does to it

    def needs_host_load(self, adapter: int | None) -> bool:
        return adapter is not None and adapter not in self.in_host

    def start_host_load(self, adapter: int) -> None:
        self.reading[adapter] = self.reading.get(adapter, 0) + 1

    def finish_host_load(self, adapter: int) -> None:
        """The disk read is done: the adapter counts as loaded on every rank (one rank here)."""
        self.reading[adapter] -= 1
        if not self.reading[adapter]:
            del self.reading[adapter]
        if adapter in self.in_host:
            return
        self.in_host.add(adapter)
        self.num_host_loads += 1
        self._next_op += 1
        load = LoadAdapters(op_id=self._next_op, adapters=[AdapterToLoad(lora_id=adapter, lora_name=f"a{adapter}",
                                                                         lora_path=f"/sim/a{adapter}")])  # fmt: skip
        self.scheduler.load_adapters(load, now=0.0)
        outcome = AdapterOutcome(lora_id=adapter, success=True, lora_rank=16)
        self.scheduler.add_adapter_report(AdapterReport(op_id=self._next_op, tp_rank=0, outcomes=[outcome]))

    def submit(self, req: SimRequest) -> None:
        sampling = SamplingParams(max_new_tokens=req.output_len, ignore_eos=True)
        prompt = [1 + (req.index + i) % 1000 for i in range(req.prompt_len)]
        refused = self.scheduler.add_request(TokenizedGenerateReq(str(req.index), prompt, sampling, req.adapter))
        assert not refused, refused

    def next_batch(self) -> ForwardBatch | None:
        batch = self.scheduler.schedule()
        if batch is not None:
            self.num_slot_loads += len(batch.slot_loads)
        return batch

    def slot_table_change(self) -> list[int] | None:
        """The slot table if it changed since last asked: what the scheduler process sends as `SlotsChanged`."""
        slot_table = self.scheduler.slots.slot_table()
        if slot_table == self.sent_slot_table:
            return None
        self.sent_slot_table = slot_table
        return slot_table


# ---- the simulation


@dataclass
class Result:
    num_replicas: int
    num_adapters: int
    policy: str
    num_requests: int
    rate_per_s: float  # offered, over the whole cluster
    makespan_s: float  # first arrival to last finish
    output_tokens: int
    ttft_s: list[float] = field(repr=False)
    slot_loads: int = 0  # adapters copied into a device slot (a request's adapter was not resident)
    host_loads: int = 0  # adapters read from disk by a replica (first use there)

    @property
    def throughput_tok_s(self) -> float:
        return self.output_tokens / self.makespan_s

    @property
    def ttft_p50_s(self) -> float:
        return statistics.median(self.ttft_s)

    @property
    def ttft_p99_s(self) -> float:
        return _percentile(self.ttft_s, 0.99)

    @property
    def slot_misses_per_request(self) -> float:
        return self.slot_loads / self.num_requests


def simulate(num_replicas: int, workload: Workload, policy: str, shape: ReplicaShape = ReplicaShape(),
             cost: StepCost = StepCost()) -> Result:  # fmt: skip
    requests = workload.requests()
    replicas = [Replica(i, shape) for i in range(num_replicas)]
    router = POLICIES[policy](random.Random(workload.seed + 1))
    events: list[tuple[float, int, str, object]] = []  # (time, tie-break, kind, payload)
    seq = 0

    def push(time_s: float, kind: str, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (time_s, seq, kind, payload))

    def run_next(replica: Replica, now: float) -> None:
        batch = replica.next_batch()
        replica.busy = batch is not None
        slot_table = replica.slot_table_change()
        if slot_table is not None:
            router.slots_changed(replica.index, slot_table)
        if batch is not None:
            push(now + cost.of(batch), "pass done", (replica, batch))

    for req in requests:
        push(req.arrival_s, "arrival", req)
    first_token: dict[int, float] = {}
    finished_at = 0.0
    output_tokens = 0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrival":
            req = payload
            replica = replicas[router.pick(replicas, req.adapter)]
            if replica.needs_host_load(req.adapter):
                replica.start_host_load(req.adapter)
                push(now + cost.host_load_s, "read", (replica, req))
                continue
            replica.submit(req)
        elif kind == "read":
            replica, req = payload
            replica.finish_host_load(req.adapter)
            replica.submit(req)
        else:
            replica, batch = payload
            for delta in replica.scheduler.process_result(BatchResult(batch.batch_id, [TOKEN] * len(batch.reqs))):
                rid = int(delta.rid)
                assert delta.finish_reason in (None, "length"), delta
                output_tokens += len(delta.token_ids)
                first_token.setdefault(rid, now)
                if delta.finish_reason:
                    finished_at = max(finished_at, now)
                    router.finished(replica.index, requests[rid].adapter)
            replica.busy = False
        if not replica.busy:
            run_next(replica, now)
    assert len(first_token) == len(requests), "a request never ran"
    return Result(
        num_replicas=num_replicas, num_adapters=workload.num_adapters, policy=policy, num_requests=len(requests),
        rate_per_s=workload.rate_per_s,
        makespan_s=finished_at - requests[0].arrival_s, output_tokens=output_tokens,
        ttft_s=[first_token[r.index] - r.arrival_s for r in requests],
        slot_loads=sum(r.num_slot_loads for r in replicas), host_loads=sum(r.num_host_loads for r in replicas),
    )  # fmt: skip


def _accumulate(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for v in values:
        total += v
        out.append(total)
    return out


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]
