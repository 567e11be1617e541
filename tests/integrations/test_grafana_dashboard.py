"""deploy/grafana/loraplex-dashboard.json queries only series the server exports, with labels they carry.

Every PromQL expression (panel targets and variable queries) is parsed with a real PromQL parser; its selectors'
metric names, matcher labels and grouping labels are compared with a /metrics exposition: here one rendered by
frontend/metrics.py after traffic, adapter operations and a scheduler update; tests/server/test_demo_trained.py repeats
the comparison against a live server's scrape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import promql_parser
import pytest
from loraplex.frontend.metrics import Metrics
from loraplex.protocol.structs import SchedulerStats
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_metrics import finished

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "loraplex-dashboard.json"
# Grafana's variables, as a query would see them once Grafana has substituted them.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$instance": ".*", "$adapter": ".*"}
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"instance", "job"}


def dashboard_panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def dashboard_exprs(dashboard: dict) -> list[str]:
    exprs = [target["expr"] for panel in dashboard_panels(dashboard) for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(SELECTOR, LABEL) is Grafana's, not PromQL: its selector is.
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
            assert match, variable["definition"]
            exprs.append(f"count by ({match[2]}) ({match[1]})")
    return exprs


def _substitute(expr: str) -> str:
    for name, value in sorted(GRAFANA_VARIABLES.items(), key=lambda item: -len(item[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def _walk(node) -> Iterator:
    yield node
    children = []
    if isinstance(node, promql_parser.BinaryExpr):
        children = [node.lhs, node.rhs]
    elif isinstance(node, promql_parser.AggregateExpr):
        children = [node.expr] + ([node.param] if node.param is not None else [])
    elif isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
        children = [node.expr]
    elif isinstance(node, promql_parser.Call):
        children = list(node.args)
    elif isinstance(node, promql_parser.MatrixSelector):
        children = [node.vector_selector]
    for child in children:
        yield from _walk(child)


def referenced(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """(metric name -> label names its matchers use, labels the expression groups by)."""
    tree = promql_parser.parse(_substitute(expr))
    selectors: dict[str, set[str]] = {}
    grouping: set[str] = set()
    for node in _walk(tree):
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            matchers = {m.name for m in node.matchers.matchers} - {"__name__"}
            selectors.setdefault(node.name, set()).update(matchers)
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            grouping.update(node.modifier.labels)
    return selectors, grouping


def exported(exposition: str) -> dict[str, set[str]]:
    """sample name (with _total, _bucket, _sum, _count as exposed) -> its label names."""
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def unexported(dashboard: dict, exposition: str) -> list[str]:
    """What the dashboard asks for that the exposition lacks (empty = every query can find its series)."""
    series = exported(exposition)
    problems = []
    for expr in dashboard_exprs(dashboard):
        selectors, grouping = referenced(expr)
        for name, labels in selectors.items():
            if name not in series:
                problems.append(f"{name} (in {expr!r}) is not exported")
            elif labels - series[name] - TARGET_LABELS:
                problems.append(f"{name} has no label(s) {sorted(labels - series[name] - TARGET_LABELS)}")
        available = set().union(*(series.get(name, set()) for name in selectors)) | TARGET_LABELS
        if grouping - available:
            problems.append(f"{expr!r} groups by {sorted(grouping - available)}, which its series lack")
    return problems


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _exposition_after_traffic() -> str:
    metrics = Metrics("demo")
    metrics.on_submit(8)
    metrics.on_finish(finished("upper", 8, 4))
    metrics.on_finish(finished(None, 5, 3, finish="stop"))
    metrics.on_adapter_op("load", True, 0.2)
    metrics.on_adapter_op("reload", True, 0.1)
    metrics.set_loaded(2)
    stats = SchedulerStats(
        op_id=0,
        num_running=1,
        num_waiting=1,
        kv_usage=0.5,
        running_lora_ids=[1],
        waiting_lora_ids=[2],
        slot_lora_ids=[1, -1],
    )
    metrics.update_scheduler([stats], [1000], 2, {1: "upper", 2: "sort"})
    return metrics.render().decode()


def test_dashboard_queries_only_exported_series() -> None:
    dashboard = load_dashboard()
    exprs = dashboard_exprs(dashboard)
    assert len(exprs) >= 20
    assert unexported(dashboard, _exposition_after_traffic()) == []
    # The topics the dashboard is for: per-adapter traffic, load latency, slots, KV use, TTFT and ITL.
    names = set().union(*(referenced(expr)[0] for expr in exprs))
    for wanted in (
        "loraplex_adapter_requests_total",
        "loraplex_adapter_load_seconds_bucket",
        "loraplex_adapter_resident",
        "vllm:lora_requests_info",
        "vllm:kv_cache_usage_perc",
        "loraplex_time_to_first_token_seconds_bucket",
        "loraplex_inter_token_latency_seconds_bucket",
    ):
        assert wanted in names, wanted


def test_the_check_catches_a_wrong_name_or_label() -> None:
    exposition = _exposition_after_traffic()
    dashboard = load_dashboard()
    broken = json.loads(json.dumps(dashboard))
    target = next(t for p in dashboard_panels(broken) for t in p.get("targets", []))
    target["expr"] = 'sum(rate(loraplex_time_to_first_token_seconds{instance=~"$instance"}[$__rate_interval]))'
    assert any("loraplex_time_to_first_token_seconds " in p for p in unexported(broken, exposition))
    target["expr"] = "sum by (adapter) (loraplex_adapters_loaded)"
    assert any("groups by ['adapter']" in p for p in unexported(broken, exposition))
    target["expr"] = 'loraplex_adapters_running{model="x"}'
    assert any("no label(s) ['model']" in p for p in unexported(broken, exposition))
    target["expr"] = "$unknown_variable"
    with pytest.raises(AssertionError, match="unknown Grafana variable"):
        unexported(broken, exposition)


def test_dashboard_is_well_formed() -> None:
    dashboard = load_dashboard()
    panels = list(dashboard_panels(dashboard))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and all(t["refId"] and t["expr"] for t in panel["targets"]), panel["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert {"instance", "adapter"} <= set(variables)
