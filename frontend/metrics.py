"""Metrics: Prometheus series of one server — our own loraplex_* and the vLLM gauges gateways scrape."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from frontend.request_state import RequestState
    from protocol.structs import SchedulerStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, model_name: str):
        # A registry per server, so several servers or Engines can live in one process.
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("loraplex_requests", "Finished requests", ["finish"], registry=r)
        self.prompt_tokens = Counter("loraplex_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("loraplex_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("loraplex_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("loraplex_inter_token_latency_seconds", "Time between output tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("loraplex_e2e_request_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.adapter_ops = Counter("loraplex_adapter_operations", "Adapter loads and unloads", ["op", "result"],
                                   registry=r)
        self.resident = Gauge("loraplex_adapters_loaded", "Adapters loaded", registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", ["model_name"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests running", ["model_name"], registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (0-1)", ["model_name"], registry=r)
        self.lora_info = Gauge("vllm:lora_requests_info", "Running and waiting LoRA adapters",
                               ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self.model_name = model_name

    def on_submit(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_finish(self, state: RequestState) -> None:
        now = time.monotonic()
        reason = "error" if state.error else (state.finish_reason or {}).get("type", "abort")
        self.requests.labels(finish=reason).inc()
        self.generation_tokens.inc(len(state.output_ids))
        self.e2e.observe(now - state.created_at)
        if state.first_token_at is not None:
            self.ttft.observe(state.first_token_at - state.created_at)
        times = state.token_times
        for earlier, later in zip(times, times[1:], strict=False):
            if later > earlier:
                self.itl.observe(later - earlier)

    def on_adapter_op(self, op: str, success: bool) -> None:
        self.adapter_ops.labels(op=op, result="success" if success else "failure").inc()

    def set_resident(self, count: int) -> None:
        self.resident.set(count)

    def update_scheduler(self, stats: SchedulerStats, max_lora: int, names: dict[int, str]) -> None:
        self.waiting.labels(model_name=self.model_name).set(stats.num_waiting)
        self.running.labels(model_name=self.model_name).set(stats.num_running)
        self.kv_usage.labels(model_name=self.model_name).set(stats.kv_usage)
        running = ",".join(sorted({names[i] for i in stats.running_lora_ids if i in names}))
        waiting = ",".join(sorted({names[i] for i in stats.waiting_lora_ids if i in names}))
        self.lora_info.clear()  # one series at a time: stale label sets are dropped
        self.lora_info.labels(max_lora=str(max_lora), running_lora_adapters=running,
                              waiting_lora_adapters=waiting).set(time.time())

    def render(self) -> bytes:
        return generate_latest(self.registry)
