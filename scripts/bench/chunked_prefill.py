"""Chunked prefill: what a long prompt's arrival costs the requests already decoding, chunked against whole.

    python -m scripts.bench chunked_prefill               # full: 32 streams, ten 1,536-token prompts
    python -m scripts.bench chunked_prefill --quick --json out.json

32 decoding streams (closed loop, 32-token prompts, outputs uniform in 64-192 tokens, round robin over 8 adapters)
run while a 1,536-token prompt (1 token out) arrives every max(2 s, 2 x its prefill time), 10 arrivals. Its prefill
time is the TTFT of a lone such prompt on the idle whole-prompt server (best of two), and the same arrival clock
serves both servers. Two servers, one after the other, the same flags but `--chunked-prefill-size`: the default
(512 on a CPU, 2048 on CUDA) and -1 (whole prompts up to --max-prefill-tokens). Ratio: the streams' ITL p99 over the
arrivals' window, chunked / whole (best of the repeats by p99; repeat i uses long prompts of seed + i, so the prefix
cache, on in both, never serves one).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import scripts.bench.serving as bench_serving
from scripts.bench.model import BenchModel
from scripts.bench.report import Targets, best_of, distribution_ms, versus
from scripts.bench.server import each_server
from scripts.bench.workload import BenchRequest, WorkloadSpec, make_workload

SEED_OF_LONE_PROMPTS = 1_000_000  # the prefill-time probes: a stream of their own, never a measured prompt


@dataclass(frozen=True)
class Plan:
    size: str
    num_adapters: int
    num_streams: int
    stream_input_len: int
    stream_output_len: int  # mean; uniform in [1/2, 3/2] of it
    long_prompt_len: int
    num_arrivals: int
    min_interval_s: float
    settle_s: float  # the streams run this long before the first arrival


FULL = Plan(size="full", num_adapters=8, num_streams=32, stream_input_len=32, stream_output_len=128,
            long_prompt_len=1536, num_arrivals=10, min_interval_s=2.0, settle_s=3.0)
QUICK = replace(FULL, size="quick", num_streams=8, stream_output_len=64, long_prompt_len=1024, num_arrivals=2,
                settle_s=1.0)

SIDES = {"whole": ("--chunked-prefill-size", "-1"), "chunked": ()}  # whole first: it measures the prefill time

TARGETS: Targets = {
    "chunked_itl": ("ITL p99 of {num_streams} decoding streams while {long_prompt_len}-token prompts arrive, "
                    "chunked / whole prefill", "<= 0.5", lambda v: v <= 0.5),
}


def long_prompts(plan: Plan, adapters: list[str], seed: int, num: int) -> list[BenchRequest]:
    spec = WorkloadSpec(num_requests=num, input_len_range=(plan.long_prompt_len,) * 2, output_len_range=(1, 1),
                        adapter_names=tuple(adapters), seed=seed)
    return make_workload(spec)


async def lone_prefill_s(url: str, plan: Plan, adapters: list[str]) -> float:
    """TTFT of a long prompt on the idle server, best of two (the first also warms the long shapes)."""
    ttfts = []
    for request in long_prompts(plan, adapters, SEED_OF_LONE_PROMPTS, 2):
        [result], _ = await bench_serving.run_requests(url, [request], progress=False)
        if not result.ok:
            raise RuntimeError(f"lone long prompt failed: {result.error}")
        ttfts.append(result.ttft_s)
    return min(ttfts)


async def run_once(url: str, plan: Plan, adapters: list[str], interval_s: float, seed: int) -> dict:
    run_start, stop = time.perf_counter(), asyncio.Event()
    streams = asyncio.create_task(bench_serving.steady_stream(
        url, list(adapters), plan.num_streams, plan.stream_input_len, plan.stream_output_len, seed, run_start, stop))
    arrivals = [replace(r, arrival_s=plan.settle_s + k * interval_s)
                for k, r in enumerate(long_prompts(plan, adapters, seed, plan.num_arrivals))]
    window_start = time.perf_counter() - run_start + plan.settle_s
    window_end = window_start + plan.num_arrivals * interval_s
    long_results, _ = await bench_serving.run_requests(url, arrivals, progress=False)
    await asyncio.sleep(max(0.0, run_start + window_end - time.perf_counter()))
    stop.set()
    stream_results = await streams
    errors = [r.error for r in [*long_results, *stream_results] if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed; first: {errors[0]}")
    gaps = bench_serving.gaps_between(stream_results, window_start, window_end)
    return {"stream_itl_ms": distribution_ms(gaps), "max_gap_ms": max(gaps, default=float("nan")) * 1e3,
            "num_gaps": len(gaps), "long_ttft_ms": distribution_ms([r.ttft_s for r in long_results]),
            "window_s": window_end - window_start}


def benchmark(bench: BenchModel, plan: Plan, *, dtype: str, server_threads: int, repeats: int, seed: int) -> dict:
    """Both servers, one after the other: {'whole', 'chunked'} (best runs), the interval, 'measured' ratios."""
    adapter_dirs = bench.first_adapters(plan.num_adapters)
    adapters = list(adapter_dirs)
    results: dict = {"plan": plan.__dict__, "lone_prefill_ms": {}}
    interval_s = None
    for side, server in each_server(bench.base_dir, adapter_dirs, SIDES, dtype=dtype,
                                    server_threads=server_threads, max_running_requests=plan.num_streams + 1):
        asyncio.run(bench_serving.warm_up(server.url, [BenchRequest(0, [5] * plan.stream_input_len, 4, name, 0.0)
                                                       for name in adapters], None))
        prefill_s = asyncio.run(lone_prefill_s(server.url, plan, adapters))
        results["lone_prefill_ms"][side] = prefill_s * 1e3
        interval_s = interval_s or max(plan.min_interval_s, 2 * prefill_s)
        runs = []
        for i in range(repeats):
            run = asyncio.run(run_once(server.url, plan, adapters, interval_s, seed + i))
            print(f"== {side} prefill, run {i + 1}: stream ITL p50 {run['stream_itl_ms']['p50']:.1f} / p99 "
                  f"{run['stream_itl_ms']['p99']:.1f} / max {run['max_gap_ms']:.1f} ms over "
                  f"{run['window_s']:.1f} s; long prompts' TTFT p50 {run['long_ttft_ms']['p50']:.0f} ms "
                  f"(lone: {prefill_s * 1e3:.0f} ms)", flush=True)
            runs.append(run)
        results[side] = best_of(runs, lambda r: r["stream_itl_ms"]["p99"], lower_is_better=True)
    results["interval_s"] = interval_s
    results["measured"] = measure_ratios(results)
    return results


def measure_ratios(results: dict) -> dict[str, tuple[float, str]]:
    chunked, whole = (results[side]["stream_itl_ms"]["p99"] for side in ("chunked", "whole"))
    return {"chunked_itl": versus(chunked, whole, "ms", note=f" (a prompt every {results['interval_s']:.1f} s)")}
