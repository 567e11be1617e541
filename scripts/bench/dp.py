"""Data parallelism: the same requests through one replica, then through `--dp-size 2`, on this machine.

    python -m scripts.bench dp                  # full: 8 adapters, 64 requests, 16 concurrent
    python -m scripts.bench dp --quick --json out.json

64 requests (inputs and outputs 16-128 tokens) on 8 adapters (uniform), 16 concurrent (closed loop), through a
server with one replica, then one with `--dp-size 2` and otherwise the same flags. Both get the same
torch threads in total: the two replicas' workers split `--server-threads` between them, so the ratio shows what a
second replica buys on the same cores. Ratio: output throughput dp 2 / dp 1 (best of the repeats). On a machine with
as many cores as one worker already uses (2 here) it can only be about 1: the replicas' forward passes then share
the cores that one replica's larger batches used, and each step's weights are read twice instead of once; a second
replica pays off with devices (or cores) of its own. On a machine whose cores other processes keep busy, the ratio
reads well above 1 instead: one replica's two-thread worker then waits at every op's barrier for a descheduled
thread, which two single-thread replicas never do, so it measures that contention, not what a replica adds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import scripts.bench.serving as bench_serving
from scripts.bench.model import BenchModel
from scripts.bench.report import Targets, best_of, versus
from scripts.bench.server import start_server
from scripts.bench.workload import WorkloadSpec, make_workload


@dataclass(frozen=True)
class Plan:
    size: str
    num_adapters: int
    input_len_range: tuple[int, int]
    output_len_range: tuple[int, int]
    num_requests: int
    concurrency: int
    dp_size: int

    def spec(self, adapter_names: tuple[str, ...], seed: int) -> WorkloadSpec:
        return WorkloadSpec(num_requests=self.num_requests, input_len_range=self.input_len_range,
                            output_len_range=self.output_len_range, adapter_names=adapter_names, seed=seed)


FULL = Plan(size="full", num_adapters=8, input_len_range=(16, 128), output_len_range=(16, 128), num_requests=64,
            concurrency=16, dp_size=2)
QUICK = Plan(size="quick", num_adapters=2, input_len_range=(8, 16), output_len_range=(4, 8), num_requests=24,
             concurrency=8, dp_size=2)

TARGETS: Targets = {
    "dp_throughput": ("throughput, --dp-size {dp_size} / one replica (same cores; {num_adapters} adapters, "
                      "{concurrency} concurrent)", "~1 on 2 cores", lambda v: v >= 0.8),
}


def benchmark(bench: BenchModel, plan: Plan, *, dtype: str, server_threads: int, repeats: int, seed: int) -> dict:
    """One replica, then plan.dp_size, one after the other: {'dp1', 'dpN'} (best runs), 'measured' ratios."""
    adapters = bench.first_adapters(plan.num_adapters)
    requests = make_workload(plan.spec(tuple(adapters), seed))
    results: dict = {"plan": plan.__dict__}
    for side, dp_size in (("dp1", 1), ("dpN", plan.dp_size)):
        # The same torch threads in total: each replica's worker gets its share (0 = the workers' own default).
        threads = max(1, server_threads // dp_size) if server_threads else 0
        with start_server(bench.base_dir, adapters, dtype=dtype, server_threads=threads,
                          max_running_requests=plan.concurrency, max_loras_per_batch=plan.num_adapters,
                          extra=("--dp-size", str(dp_size))) as server:
            runs = [bench_serving.run_and_report(server.url, requests, plan.concurrency,
                                                 f"--dp-size {dp_size}, {threads or 'default'} threads per worker, "
                                                 f"run {i + 1}")
                    for i in range(repeats)]
            routed = asyncio.run(bench_serving.get_json(server.url, "/server_info"))["replicas"]
        results[side] = best_of(runs)
        results[side]["requests_routed"] = [r["num_requests_routed"] for r in routed]
        results[side]["threads_per_worker"] = threads
    results["measured"] = measure_ratios(results)
    return results


def measure_ratios(results: dict) -> dict[str, tuple[float, str]]:
    one, many = results["dp1"], results["dpN"]
    one_tput, many_tput = (r["summary"]["output_token_throughput"] for r in (one, many))
    routed = "/".join(str(n) for n in many["requests_routed"])
    return {"dp_throughput": versus(many_tput, one_tput, "out tok/s", note=f" (routed {routed})")}
