"""Benchmark results: per-request records, percentile summaries, text tables and JSON files."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    index: int
    adapter: str | None
    input_len: int
    output_len: int  # requested
    num_output_tokens: int = 0  # received
    start_s: float = 0.0  # when the request was sent, from the start of the run
    ttft_s: float = math.nan
    latency_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)  # one per token after the first chunk's
    itl_times_s: list[float] = field(default_factory=list)  # when each itl_s sample's token arrived, from the run start
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.num_output_tokens == self.output_len


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float]:
    stats = {f"p{q}": percentile(values_s, q) * 1e3 for q in PERCENTILES}
    stats["mean"] = sum(values_s) / len(values_s) * 1e3 if values_s else math.nan
    return stats


def summarize(results: Iterable[RequestResult], duration_s: float) -> dict:
    """Throughputs over the run's wall time and latency percentiles of the completed requests."""
    results = list(results)
    done = [r for r in results if r.ok]
    return {
        "num_requests": len(results),
        "num_completed": len(done),
        "num_failed": len(results) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s,
        "input_token_throughput": sum(r.input_len for r in done) / duration_s,
        "output_token_throughput": sum(r.num_output_tokens for r in done) / duration_s,
        "ttft_ms": distribution_ms([r.ttft_s for r in done]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl_s]),
        "e2e_latency_ms": distribution_ms([r.latency_s for r in done]),
    }


def summarize_per_adapter(results: Sequence[RequestResult], duration_s: float) -> dict[str, dict]:
    groups: dict[str, list[RequestResult]] = {}
    for r in results:
        groups.setdefault(r.adapter or "<base>", []).append(r)
    return {name: summarize(group, duration_s) for name, group in sorted(groups.items())}


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    def cell(value: object) -> str:
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
        return str(value)

    text_rows = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text_rows)) if text_rows else len(h) for i, h in enumerate(headers)]
    line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in text_rows)])


def summary_rows(label: str, summary: dict) -> list[list[object]]:
    """One row per summary for the serving table: label, throughputs, TTFT and ITL percentiles."""
    ttft, itl = summary["ttft_ms"], summary["itl_ms"]
    return [[label, f"{summary['num_completed']}/{summary['num_requests']}", summary["request_throughput"],
             summary["output_token_throughput"], ttft["p50"], ttft["p90"], ttft["p99"],
             itl["p50"], itl["p90"], itl["p99"]]]


SUMMARY_HEADERS = ("", "done", "req/s", "out tok/s", "TTFT p50 ms", "p90", "p99", "ITL p50 ms", "p90", "p99")


# A ratio the issue targets: key -> (label, target text, passes). Labels may name fields filled in by ratio_rows.
# passes None: a ratio shown beside the others without a target (met: n/a).
Targets = dict[str, tuple[str, str, Callable[[float], bool] | None]]
RATIO_HEADERS = ("ratio", "measured", "target", "met", "from")


def ratio_rows(targets: Targets, measured: dict[str, tuple[float, str]], **label_fields: object) -> list[list[str]]:
    """One row per target: what it measures, the ratio, the target, met or not, and its two sides in words."""
    rows = []
    for key, (label, target, passes) in targets.items():
        value, detail = measured[key]
        met = "n/a" if passes is None or math.isnan(value) else "yes" if passes(value) else "NO"
        rows.append([label.format(**label_fields), f"{value:.2f}", target, met, detail])
    return rows


def versus(a: float, b: float, unit: str, digits: int = 1, note: str = "") -> tuple[float, str]:
    """A measured ratio a / b and its two sides in words (`12.3 vs 4.5 ms` + note)."""
    return a / b, f"{a:.{digits}f} vs {b:.{digits}f} {unit}{note}"


def output_throughput(run: dict) -> float:
    return run["summary"]["output_token_throughput"]


def best_of(runs: list[dict], metric: Callable[[dict], float] = output_throughput, *,
            lower_is_better: bool = False) -> dict:
    """The best of repeated runs (noise from other tenants only ever makes a run worse), with every run's metric."""
    best = dict((min if lower_is_better else max)(runs, key=metric))
    best["all_runs_metric"] = [metric(r) for r in runs]
    return best


def write_json(path: str | Path, obj: object) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # nan is not JSON; null says "not measured".
    Path(path).write_text(json.dumps(_nan_to_none(obj), indent=2, sort_keys=True) + "\n")


def _nan_to_none(obj: object) -> object:
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_nan_to_none(v) for v in obj]
    return obj
