"""Metrics: exactly API.md's series, rendered as Prometheus text and read back with prometheus_client's parser."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from loraplex.frontend.metrics import Metrics
from loraplex.protocol.structs import SchedulerStats
from prometheus_client.parser import text_string_to_metric_families

BASE = "tiny-base"
# API.md "Metrics": family -> type (counters are exposed with _total; the parser names the family without it)
SERIES = {
    "loraplex_requests": "counter",
    "loraplex_prompt_tokens": "counter",
    "loraplex_generation_tokens": "counter",
    "loraplex_adapter_requests": "counter",
    "loraplex_adapter_prompt_tokens": "counter",
    "loraplex_adapter_generation_tokens": "counter",
    "loraplex_adapter_operations": "counter",
    "loraplex_prefix_cache_hit_tokens": "counter",
    "loraplex_prefix_cache_queried_tokens": "counter",
    "loraplex_spec_draft_tokens": "counter",
    "loraplex_spec_accepted_tokens": "counter",
    "loraplex_time_to_first_token_seconds": "histogram",
    "loraplex_inter_token_latency_seconds": "histogram",
    "loraplex_e2e_request_latency_seconds": "histogram",
    "loraplex_adapter_load_seconds": "histogram",
    "loraplex_adapters_loaded": "gauge",
    "loraplex_adapters_resident": "gauge",
    "loraplex_adapters_running": "gauge",
    "loraplex_adapter_resident": "gauge",
    "loraplex_state_slots": "gauge",
    "loraplex_state_slots_free": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:lora_requests_info": "gauge",
}


def parse(text: str) -> tuple[dict[str, str], dict[tuple[str, frozenset], float]]:
    """(family -> type, (sample name, labels) -> value)."""
    families = list(text_string_to_metric_families(text))
    types = {f.name: f.type for f in families}
    samples = {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}
    return types, samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def finished(lora_name: str | None, num_prompt: int, num_output: int, finish: str = "length") -> SimpleNamespace:
    """What Metrics.on_finish reads of a RequestState."""
    return SimpleNamespace(
        lora_name=lora_name,
        prompt_ids=[1] * num_prompt,
        output_ids=[2] * num_output,
        error=None,
        finish_reason={"type": finish},
        created_at=100.0,
        first_token_at=100.5,
        token_times=[100.5 + 0.1 * i for i in range(num_output)],
    )


def serve(metrics: Metrics, lora_name: str | None, num_prompt: int, num_output: int) -> None:
    metrics.on_submit(num_prompt)
    metrics.on_finish(finished(lora_name, num_prompt, num_output))


def test_a_fresh_server_has_every_series_and_nothing_else() -> None:
    types, samples = parse(Metrics(BASE).render().decode())
    assert types == SERIES
    assert not any(name.endswith("_created") for name, _ in samples)
    for name in ("loraplex_prefix_cache_hit_tokens_total", "loraplex_prefix_cache_queried_tokens_total"):
        assert value(samples, name) == 0
    for op in ("load", "reload", "unload", "evict"):
        for result in ("success", "failure"):
            assert value(samples, "loraplex_adapter_operations_total", op=op, result=result) == 0
    for op in ("load", "reload"):
        assert value(samples, "loraplex_adapter_load_seconds_count", op=op) == 0


def test_requests_count_per_adapter_and_base() -> None:
    metrics = Metrics(BASE)
    serve(metrics, "a", 10, 4)
    serve(metrics, "a", 6, 2)
    serve(metrics, None, 3, 5)
    types, samples = parse(metrics.render().decode())
    assert types == SERIES
    assert value(samples, "loraplex_requests_total", finish="length") == 3
    assert value(samples, "loraplex_prompt_tokens_total") == 19
    assert value(samples, "loraplex_generation_tokens_total") == 11
    for adapter, (num_requests, num_prompt, num_output) in {"a": (2, 16, 6), BASE: (1, 3, 5)}.items():
        assert value(samples, "loraplex_adapter_requests_total", adapter=adapter) == num_requests
        assert value(samples, "loraplex_adapter_prompt_tokens_total", adapter=adapter) == num_prompt
        assert value(samples, "loraplex_adapter_generation_tokens_total", adapter=adapter) == num_output
    assert value(samples, "loraplex_time_to_first_token_seconds_count") == 3
    assert value(samples, "loraplex_time_to_first_token_seconds_sum") == pytest.approx(1.5)
    assert value(samples, "loraplex_inter_token_latency_seconds_count") == 3 + 1 + 4
    assert value(samples, "loraplex_e2e_request_latency_seconds_count") == 3


def test_adapter_operations_and_load_times() -> None:
    metrics = Metrics(BASE)
    metrics.on_adapter_op("load", True, 0.2)
    metrics.on_adapter_op("load", False, 0.3)  # a failure is counted, not timed
    metrics.on_adapter_op("reload", True, 0.04)
    metrics.on_adapter_op("evict", True)
    metrics.on_adapter_op("unload", True, 1.0)  # only loads and reloads are timed
    _, samples = parse(metrics.render().decode())
    ops = {(op, result): value(samples, "loraplex_adapter_operations_total", op=op, result=result)
           for op in ("load", "reload", "unload", "evict") for result in ("success", "failure")}
    assert ops == {("load", "success"): 1, ("load", "failure"): 1, ("reload", "success"): 1,
                   ("reload", "failure"): 0, ("unload", "success"): 1, ("unload", "failure"): 0,
                   ("evict", "success"): 1, ("evict", "failure"): 0}
    assert value(samples, "loraplex_adapter_load_seconds_count", op="load") == 1
    assert value(samples, "loraplex_adapter_load_seconds_sum", op="load") == pytest.approx(0.2)
    assert value(samples, "loraplex_adapter_load_seconds_bucket", op="load", le="0.25") == 1
    assert value(samples, "loraplex_adapter_load_seconds_bucket", op="load", le="0.1") == 0
    assert value(samples, "loraplex_adapter_load_seconds_count", op="reload") == 1
    with pytest.raises(AssertionError):
        metrics.on_adapter_op("swap", True)


def test_residency_gauges_follow_the_scheduler() -> None:
    metrics = Metrics(BASE)
    metrics.set_loaded(3)
    names = {1: "a", 2: "b", 3: "c"}
    stats = SchedulerStats(op_id=0, num_running=3, num_waiting=1, kv_usage=0.25, running_lora_ids=[1, 2],
                           waiting_lora_ids=[3], slot_lora_ids=[2, -1, 1, -1])
    metrics.update_scheduler([stats], [1000], 4, names)
    _, samples = parse(metrics.render().decode())
    assert value(samples, "loraplex_adapters_loaded") == 3
    assert value(samples, "loraplex_adapters_resident") == 2
    assert value(samples, "loraplex_adapters_running") == 2
    assert {a: value(samples, "loraplex_adapter_resident", adapter=a) for a in "abc"} == {"a": 1, "b": 1, "c": 0}
    info = [labels for (name, labels) in samples if name == "vllm:lora_requests_info"]
    assert [dict(labels) for labels in info] == [
        {"max_lora": "4", "running_lora_adapters": "a,b", "waiting_lora_adapters": "c"}
    ]
    assert value(samples, "vllm:num_requests_running", model_name=BASE) == 3
    # "a" leaves its slot, "c" takes one and "b" is unloaded: its series go at the next update
    stats = SchedulerStats(op_id=0, num_running=1, num_waiting=0, kv_usage=0.1, running_lora_ids=[3],
                           slot_lora_ids=[3, -1])
    metrics.update_scheduler([stats], [1000], 4, {1: "a", 3: "c"})
    _, samples = parse(metrics.render().decode())
    resident = {dict(labels)["adapter"]: v for (name, labels), v in samples.items()
                if name == "loraplex_adapter_resident"}
    assert resident == {"a": 0, "c": 1}
    assert (value(samples, "loraplex_adapters_resident"), value(samples, "loraplex_adapters_running")) == (1, 1)


def test_drop_adapter_removes_every_series_of_it() -> None:
    metrics = Metrics(BASE)
    serve(metrics, "gone", 4, 2)
    serve(metrics, "kept", 4, 2)
    metrics.update_scheduler([SchedulerStats(op_id=0, num_running=0, num_waiting=0, kv_usage=0.0, slot_lora_ids=[1])],
                             [1000], 1, {1: "gone", 2: "kept"})
    metrics.drop_adapter("gone")
    metrics.drop_adapter("never-loaded")  # a no-op
    types, samples = parse(metrics.render().decode())
    assert types == SERIES
    assert not [key for key in samples if ("adapter", "gone") in key[1]]
    for name in ("loraplex_adapter_requests_total", "loraplex_adapter_prompt_tokens_total",
                 "loraplex_adapter_generation_tokens_total", "loraplex_adapter_resident"):
        assert ("adapter", "kept") in next(labels for n, labels in samples if n == name), name
    assert value(samples, "loraplex_requests_total", finish="length") == 2  # totals keep what it served


def test_state_slot_gauges_follow_each_replica() -> None:
    """A hybrid model's state slots (all and free) per replica, as the schedulers report them; 0 before any report."""
    metrics = Metrics(BASE)
    _, samples = parse(metrics.render().decode())
    assert (value(samples, "loraplex_state_slots"), value(samples, "loraplex_state_slots_free")) == (0, 0)
    stats = SchedulerStats(op_id=0, num_running=3, num_waiting=0, kv_usage=0.2, num_state_slots=8,
                           num_free_state_slots=5)  # fmt: skip
    metrics.update_scheduler([stats], [1000], 4, {})
    _, samples = parse(metrics.render().decode())
    assert (value(samples, "loraplex_state_slots"), value(samples, "loraplex_state_slots_free")) == (8, 5)
    metrics = Metrics(BASE, dp_size=2)
    replicas = [SchedulerStats(op_id=0, num_running=r, num_waiting=0, kv_usage=0.1, num_state_slots=8,
                               num_free_state_slots=8 - r) for r in (2, 7)]  # fmt: skip
    metrics.update_scheduler(replicas, [1000, 1000], 4, {})
    types, samples = parse(metrics.render().decode())
    assert types == SERIES
    for dp_rank, free in enumerate((6, 1)):
        assert value(samples, "loraplex_state_slots", dp_rank=str(dp_rank)) == 8
        assert value(samples, "loraplex_state_slots_free", dp_rank=str(dp_rank)) == free
