"""Metrics: Prometheus series of one server — our own loraplex_* (API.md's "Metrics") and the vLLM gauges gateways
scrape. `adapter` labels carry the name clients send, the served base name for base requests. Under --dp-size the
loraplex_* gauges carry `dp_rank` (one series per replica); each vllm:* gauge stays one series over all replicas."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from loraplex.protocol.spec_stats import adapter_label, combine_spec
from loraplex.protocol.structs import SchedulerStats
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from loraplex.frontend.request_state import RequestState

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ADAPTER_OPS = ("load", "reload", "unload", "evict")
TIMED_OPS = ("load", "reload")  # observed into loraplex_adapter_load_seconds when they succeed
RESULTS = ("success", "failure")


class Metrics:
    def __init__(self, model_name: str, dp_size: int = 1):
        # A registry per server, so several servers or Engines can live in one process.
        self.registry = CollectorRegistry()
        r = self.registry
        self.model_name = model_name
        self.dp_size = dp_size
        per_replica = ["dp_rank"] if dp_size > 1 else []
        # ---- requests (the per-adapter series count a request when it ends)
        self.requests = Counter("loraplex_requests", "Finished requests", ["finish"], registry=r)
        self.prompt_tokens = Counter("loraplex_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("loraplex_generation_tokens", "Tokens generated", registry=r)
        self.adapter_requests = Counter("loraplex_adapter_requests", "Finished requests per adapter", ["adapter"],
                                        registry=r)
        self.adapter_prompt_tokens = Counter("loraplex_adapter_prompt_tokens", "Prompt tokens of finished requests "
                                             "per adapter", ["adapter"], registry=r)
        self.adapter_generation_tokens = Counter("loraplex_adapter_generation_tokens", "Tokens generated per "
                                                 "adapter", ["adapter"], registry=r)
        # 0 until a prefix cache counts into them
        self._scheduler_totals: dict[str, int] = {}  # the scheduler's cumulative counts, last seen
        self.prefix_cache_hit_tokens = Counter("loraplex_prefix_cache_hit_tokens", "Prompt tokens found in the "
                                               "prefix cache", registry=r)
        self.prefix_cache_queried_tokens = Counter("loraplex_prefix_cache_queried_tokens", "Prompt tokens looked "
                                                   "up in the prefix cache", registry=r)
        # speculative decoding, per adapter ("base": the base model's requests); 0 until a request drafts
        self.spec_draft_tokens = Counter("loraplex_spec_draft_tokens", "Draft tokens verified (speculative "
                                         "decoding)", ["adapter"], registry=r)
        self.spec_accepted_tokens = Counter("loraplex_spec_accepted_tokens", "Draft tokens accepted (speculative "
                                            "decoding)", ["adapter"], registry=r)
        self._spec_totals: dict[tuple[str, int | None], int] = {}  # the schedulers' cumulative counts, last seen
        self.ttft = Histogram("loraplex_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("loraplex_inter_token_latency_seconds", "Time between output tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("loraplex_e2e_request_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS,
                             registry=r)
        # ---- adapters
        self.adapter_ops = Counter("loraplex_adapter_operations", "Adapter loads, reloads, unloads and evictions",
                                   ["op", "result"], registry=r)
        self.adapter_load_seconds = Histogram("loraplex_adapter_load_seconds", "Time a successful adapter load or "
                                              "reload took", ["op"], buckets=LATENCY_BUCKETS, registry=r)
        for op in ADAPTER_OPS:  # every series from the start, at 0, so that rates over them are defined
            for result in RESULTS:
                self.adapter_ops.labels(op=op, result=result)
        for op in TIMED_OPS:
            self.adapter_load_seconds.labels(op=op)
        self.adapters_loaded = Gauge("loraplex_adapters_loaded", "Adapters loaded", per_replica, registry=r)
        self.adapters_resident = Gauge("loraplex_adapters_resident", "Adapters in a device slot", per_replica,
                                       registry=r)
        self.adapters_running = Gauge("loraplex_adapters_running", "Adapters with requests running", per_replica,
                                      registry=r)
        self.adapter_resident = Gauge("loraplex_adapter_resident", "1 while the adapter is in a device slot, 0 "
                                      "while it is loaded but not", ["adapter", *per_replica], registry=r)
        self.per_adapter = (self.adapter_requests, self.adapter_prompt_tokens, self.adapter_generation_tokens)
        # ---- a hybrid model's per-request state (linear-attention layers): one slot per running request, beside its
        # KV pages; 0 and 0 for a model without such layers
        self.state_slots = Gauge("loraplex_state_slots", "Linear-attention state slots", per_replica, registry=r)
        self.state_slots_free = Gauge("loraplex_state_slots_free", "Linear-attention state slots free", per_replica,
                                      registry=r)  # fmt: skip
        # ---- the vLLM gauges, one series each
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", ["model_name"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests running", ["model_name"], registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (0-1)", ["model_name"], registry=r)
        self.lora_info = Gauge("vllm:lora_requests_info", "Running and waiting LoRA adapters",
                               ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)

    # ---- requests

    def on_submit(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_finish(self, state: RequestState) -> None:
        now = time.monotonic()
        reason = "error" if state.error else (state.finish_reason or {}).get("type", "abort")
        self.requests.labels(finish=reason).inc()
        self.generation_tokens.inc(len(state.output_ids))
        adapter = state.lora_name if state.lora_name is not None else self.model_name
        self.adapter_requests.labels(adapter=adapter).inc()
        self.adapter_prompt_tokens.labels(adapter=adapter).inc(len(state.prompt_ids))
        self.adapter_generation_tokens.labels(adapter=adapter).inc(len(state.output_ids))
        self.e2e.observe(now - state.created_at)
        if state.first_token_at is not None:
            self.ttft.observe(state.first_token_at - state.created_at)
        times = state.token_times
        for earlier, later in zip(times, times[1:], strict=False):
            if later > earlier:
                self.itl.observe(later - earlier)

    # ---- adapters

    def on_adapter_op(self, op: str, success: bool, seconds: float | None = None) -> None:
        """op: load, reload, unload or evict; `seconds` of a successful load or reload goes into the histogram."""
        assert op in ADAPTER_OPS, op
        self.adapter_ops.labels(op=op, result="success" if success else "failure").inc()
        if success and seconds is not None and op in TIMED_OPS:
            self.adapter_load_seconds.labels(op=op).observe(seconds)

    def drop_adapter(self, name: str) -> None:
        """Forget every series of an unloaded adapter."""
        for metric in self.per_adapter:
            metric.remove(name)
        for dp_rank in range(self.dp_size):
            self.adapter_resident.remove(*self._series_labels(dp_rank, adapter=name).values())

    def set_loaded(self, num: int) -> None:
        """Adapters loaded: the same on every replica (loads are all-or-nothing across them)."""
        for dp_rank in range(self.dp_size):
            self._series(self.adapters_loaded, dp_rank).set(num)

    def _series_labels(self, dp_rank: int, **labels: str) -> dict[str, str]:
        return {**labels, "dp_rank": str(dp_rank)} if self.dp_size > 1 else labels

    def _series(self, gauge: Gauge, dp_rank: int, **labels: str) -> Gauge:
        """A loraplex_* gauge's series for one replica (the unlabelled gauge itself when there is one replica)."""
        labels = self._series_labels(dp_rank, **labels)
        return gauge.labels(**labels) if labels else gauge

    def update_scheduler(self, replicas: list[SchedulerStats], capacities: list[int], max_loras: int,
                         names: dict[int, str]) -> None:
        """The gauges from the schedulers' view, by dp_rank; `capacities`: each replica's KV tokens; `names` maps
        lora_id -> name for every loaded adapter."""
        stats = combine_stats(replicas, capacities)
        # The schedulers count prefix-cache tokens since their start; the counters advance by what is new.
        for name, counter, total in (
            ("hit", self.prefix_cache_hit_tokens, stats.prefix_cache_hit_tokens),
            ("queried", self.prefix_cache_queried_tokens, stats.prefix_cache_queried_tokens),
        ):
            counter.inc(max(0, total - self._scheduler_totals.get(name, 0)))
            self._scheduler_totals[name] = max(total, self._scheduler_totals.get(name, 0))
        for count in combine_spec(replicas):
            label = adapter_label(count.lora_id, names)
            for kind, counter, total in (("draft", self.spec_draft_tokens, count.num_draft_tokens),
                                         ("accepted", self.spec_accepted_tokens, count.num_accepted_tokens)):
                key = (kind, count.lora_id)
                counter.labels(adapter=label).inc(max(0, total - self._spec_totals.get(key, 0)))
                self._spec_totals[key] = max(total, self._spec_totals.get(key, 0))
        self.waiting.labels(model_name=self.model_name).set(stats.num_waiting)
        self.running.labels(model_name=self.model_name).set(stats.num_running)
        self.kv_usage.labels(model_name=self.model_name).set(stats.kv_usage)
        running = ",".join(sorted({names[i] for i in stats.running_lora_ids if i in names}))
        waiting = ",".join(sorted({names[i] for i in stats.waiting_lora_ids if i in names}))
        self.lora_info.clear()  # one series at a time: stale label sets are dropped
        self.lora_info.labels(max_lora=str(max_loras * len(replicas)), running_lora_adapters=running,
                              waiting_lora_adapters=waiting).set(time.time())
        self.adapter_resident.clear()  # exactly the loaded adapters
        for dp_rank, replica in enumerate(replicas):
            resident_ids = {i for i in replica.slot_lora_ids if i != -1}
            self._series(self.adapters_resident, dp_rank).set(len(resident_ids))
            self._series(self.adapters_running, dp_rank).set(len(set(replica.running_lora_ids)))
            self._series(self.state_slots, dp_rank).set(replica.num_state_slots)
            self._series(self.state_slots_free, dp_rank).set(replica.num_free_state_slots)
            for lora_id, name in names.items():
                self._series(self.adapter_resident, dp_rank, adapter=name).set(1 if lora_id in resident_ids else 0)

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))


def combine_stats(replicas: list[SchedulerStats], capacities: list[int]) -> SchedulerStats:
    """All replicas as one scheduler: counts summed, KV usage = used / total tokens, adapter ids the union; the slot
    table is one replica's alone, so the total has none."""
    if len(replicas) == 1:
        return replicas[0]
    used = sum(s.kv_usage * capacity for s, capacity in zip(replicas, capacities, strict=True))
    return SchedulerStats(
        op_id=0,
        num_running=sum(s.num_running for s in replicas),
        num_waiting=sum(s.num_waiting for s in replicas),
        kv_usage=used / max(1, sum(capacities)),
        running_lora_ids=sorted({i for s in replicas for i in s.running_lora_ids}),
        waiting_lora_ids=sorted({i for s in replicas for i in s.waiting_lora_ids}),
        prefix_cache_hit_tokens=sum(s.prefix_cache_hit_tokens for s in replicas),
        prefix_cache_queried_tokens=sum(s.prefix_cache_queried_tokens for s in replicas),
        num_preemptions=sum(s.num_preemptions for s in replicas),
        num_loaded_adapters=min(s.num_loaded_adapters for s in replicas),
        num_state_slots=sum(s.num_state_slots for s in replicas),
        num_free_state_slots=sum(s.num_free_state_slots for s in replicas),
        num_state_snapshots=sum(s.num_state_snapshots for s in replicas),
        num_free_state_snapshots=sum(s.num_free_state_snapshots for s in replicas),
    )


class _WithoutCreated:
    """The registry without prometheus_client's *_created samples: the exposition is exactly API.md's series
    (without touching the process-wide switch, which would reach other registries in an embedding process)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
