"""Fair sharing between adapters: one hot adapter sending ten times the others' rate, through a server with fair
admission (virtual token counters) and one with `--disable-adapter-fairness`.

    python -m scripts.bench fairness --quick              # the small model, a minute of arrivals per server
    python -m scripts.bench fairness --json out.json      # the full plan

The workload: Poisson arrivals, each request the hot adapter's with ten times the probability of each of the cold
ones (so each adapter's requests are a Poisson stream, the hot one at ten times the rate), the hot adapter's rate
`hot_load` times the server's capacity, measured first with a closed loop of --max-running-requests streams on the
fair server. So the hot adapter alone asks for more than the server can give: first come, first served makes every
cold request wait behind its growing backlog; fair admission serves the cold adapters, each far below its share, as
they come. Both
servers run the very same requests (same seed). Ratios: the cold adapters' TTFT p99, fair / unfair (target <= 0.3),
and total output throughput, fair / unfair (target >= 0.95: fairness costs no throughput).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import scripts.bench.serving as bench_serving
from scripts.bench.model import BenchModel
from scripts.bench.report import (
    SUMMARY_HEADERS,
    RequestResult,
    Targets,
    format_table,
    summarize,
    summary_rows,
    versus,
)
from scripts.bench.server import each_server
from scripts.bench.workload import BenchRequest, WorkloadSpec, make_workload

HOT_FACTOR = 10  # the hot adapter's rate over each cold one's


@dataclass(frozen=True)
class Plan:
    size: str
    num_adapters: int  # one hot, the rest cold
    input_len_range: tuple[int, int]
    output_len_range: tuple[int, int]
    max_running_requests: int
    arrival_s: float  # arrivals span this long
    hot_load: float  # the hot adapter's arrival rate over the measured capacity
    num_calibration_requests: int


FULL = Plan(size="full", num_adapters=4, input_len_range=(64, 128), output_len_range=(64, 128),
            max_running_requests=16, arrival_s=120.0, hot_load=1.5, num_calibration_requests=64)
QUICK = Plan(size="quick", num_adapters=4, input_len_range=(16, 32), output_len_range=(16, 32),
             max_running_requests=8, arrival_s=60.0, hot_load=1.5, num_calibration_requests=32)

SIDES = {"fair": (), "unfair": ("--disable-adapter-fairness",)}

TARGETS: Targets = {
    "cold_ttft_p99": ("cold adapters' TTFT p99, fair / unfair (hot adapter at {hot_factor}x each cold one's rate, "
                      "the hot one alone at {hot_load}x capacity)", "<= 0.3", lambda v: v <= 0.3),
    "throughput": ("output throughput, fair / unfair (same requests)", ">= 0.95", lambda v: v >= 0.95),
}


def workload(plan: Plan, adapter_names: tuple[str, ...], rate: float, seed: int) -> list[BenchRequest]:
    hot, cold = adapter_names[0], adapter_names[1:]
    # The hot adapter named HOT_FACTOR times: uniform choices give it HOT_FACTOR times each cold one's share.
    spec = WorkloadSpec(num_requests=max(1, round(rate * plan.arrival_s)), input_len_range=plan.input_len_range,
                        output_len_range=plan.output_len_range, adapter_names=(hot,) * HOT_FACTOR + cold,
                        request_rate=rate, seed=seed)
    return make_workload(spec)


def capacity(url: str, plan: Plan, adapter_names: tuple[str, ...], seed: int) -> float:
    """Requests per second the server completes with every running place busy (closed loop)."""
    spec = WorkloadSpec(num_requests=plan.num_calibration_requests, input_len_range=plan.input_len_range,
                        output_len_range=plan.output_len_range, adapter_names=adapter_names, seed=seed + 1000)
    result = asyncio.run(bench_serving.benchmark(url, make_workload(spec), concurrency=plan.max_running_requests,
                                                 desc="capacity"))
    return result["summary"]["request_throughput"]


def run_side(url: str, requests: list[BenchRequest], hot: str, desc: str) -> dict:
    async def run() -> tuple[list[RequestResult], float]:
        await bench_serving.warm_up(url, requests, None)
        return await bench_serving.run_requests(url, requests, desc=desc)

    results, duration_s = asyncio.run(run())
    side = {"all": summarize(results, duration_s),
            "hot": summarize([r for r in results if r.adapter == hot], duration_s),
            "cold": summarize([r for r in results if r.adapter != hot], duration_s)}
    print(f"\n== {desc}")
    print(format_table(SUMMARY_HEADERS, [row for name, s in side.items() for row in summary_rows(name, s)]))
    return side


def benchmark(bench: BenchModel, plan: Plan, *, dtype: str, server_threads: int, repeats: int, seed: int) -> dict:
    """Capacity on the fair server, then the same overload through both: {'fair', 'unfair'}, 'measured' ratios.
    (repeats: each side's run is one long open-loop run; a repeat would only lengthen it.)"""
    adapter_dirs = bench.first_adapters(plan.num_adapters)
    adapter_names = tuple(adapter_dirs)
    results: dict = {"plan": {**plan.__dict__, "hot_factor": HOT_FACTOR}}
    requests: list[BenchRequest] = []
    for side, server in each_server(bench.base_dir, adapter_dirs, SIDES, dtype=dtype,
                                    server_threads=server_threads, max_running_requests=plan.max_running_requests):
        if not requests:
            results["capacity_rps"] = capacity(server.url, plan, adapter_names, seed)
            # The total rate: the hot adapter's, plus a tenth of it for each cold one.
            num_cold = plan.num_adapters - 1
            results["rate_rps"] = plan.hot_load * results["capacity_rps"] * (1 + num_cold / HOT_FACTOR)
            requests = workload(plan, adapter_names, results["rate_rps"], seed)
            print(f"capacity {results['capacity_rps']:.2f} req/s: {len(requests)} requests at "
                  f"{results['rate_rps']:.2f} req/s over {plan.arrival_s:.0f} s")
        results[side] = run_side(server.url, requests, adapter_names[0], f"fairness: {side}")
    results["measured"] = measure_ratios(results)
    return results


def measure_ratios(results: dict) -> dict[str, tuple[float, str]]:
    fair, unfair = results["fair"], results["unfair"]
    fair_ttft, unfair_ttft = (s["cold"]["ttft_ms"]["p99"] for s in (fair, unfair))
    fair_tput, unfair_tput = (s["all"]["output_token_throughput"] for s in (fair, unfair))
    failed = sum(s["all"]["num_failed"] for s in (fair, unfair))
    return {
        "cold_ttft_p99": versus(fair_ttft, unfair_ttft, "ms", digits=0),
        "throughput": versus(fair_tput, unfair_tput, "out tok/s", note=f", {failed} failed"),
    }
