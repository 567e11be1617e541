"""The prefix cache on shared system prompts: the same requests through a server with it on, then one with it off.

    python -m scripts.bench prefix_cache                  # full: 8 adapters x 4 system prompts of 512 tokens
    python -m scripts.bench prefix_cache --quick --json out.json

Every prompt is one of 4 system prompts of 512 tokens followed by its own user turn of 32-64 tokens, on one of 8
adapters (uniform); 128 requests, 32 concurrent (closed loop), outputs of exact length. The cache is keyed by adapter,
so there are 8 x 4 = 32 distinct prefixes to compute once. Two servers, started one after the other with the same
flags but `--disable-radix-cache`, run the same requests (same seed); each repeat uses seed + i, so a repeat on the
cache-on server cannot hit the previous repeat's prompts. Ratios: output throughput on / off (best of the repeats
by throughput) and TTFT p50 on / off (best of the repeats by TTFT p50).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import scripts.bench.serving as bench_serving
from scripts.bench.model import BenchModel
from scripts.bench.report import Targets, best_of, versus
from scripts.bench.server import each_server
from scripts.bench.workload import WorkloadSpec, make_workload


@dataclass(frozen=True)
class Plan:
    size: str
    num_adapters: int
    num_system_prompts: int
    system_prompt_len: int
    user_len_range: tuple[int, int]
    output_len_range: tuple[int, int]
    num_requests: int
    concurrency: int

    def spec(self, adapter_names: tuple[str, ...], seed: int) -> WorkloadSpec:
        return WorkloadSpec(num_requests=self.num_requests, input_len_range=self.user_len_range,
                            output_len_range=self.output_len_range, adapter_names=adapter_names, seed=seed,
                            num_system_prompts=self.num_system_prompts, system_prompt_len=self.system_prompt_len)


FULL = Plan(size="full", num_adapters=8, num_system_prompts=4, system_prompt_len=512, user_len_range=(32, 64),
            output_len_range=(32, 64), num_requests=128, concurrency=32)
QUICK = Plan(size="quick", num_adapters=2, num_system_prompts=2, system_prompt_len=128, user_len_range=(8, 16),
             output_len_range=(4, 8), num_requests=24, concurrency=8)

SIDES = {"cache_on": (), "cache_off": ("--disable-radix-cache",)}

TARGETS: Targets = {
    "prefix_throughput": ("throughput, prefix cache on / off ({num_adapters} adapters x {num_system_prompts} "
                          "system prompts of {system_prompt_len} tokens, {concurrency} concurrent)", ">= 2",
                          lambda v: v >= 2),
    "prefix_ttft": ("TTFT p50, prefix cache on / off (same requests)", "<= 0.5", lambda v: v <= 0.5),
}


def run_side(url: str, plan: Plan, adapter_names: tuple[str, ...], seed: int, desc: str) -> dict:
    before = asyncio.run(bench_serving.get_json(url, "/server_info"))["prefix_cache_hit_tokens"]
    result = bench_serving.run_and_report(url, make_workload(plan.spec(adapter_names, seed)), plan.concurrency, desc)
    after = asyncio.run(bench_serving.get_json(url, "/server_info"))["prefix_cache_hit_tokens"]
    summary = result["summary"]
    # Warm-up prompts are reversed (bench_serving.warm_up), so every hit is a measured request's.
    result["prefix_cache_hit_share"] = (after - before) / (summary["input_token_throughput"] * summary["duration_s"])
    print(f"prefix cache hits: {result['prefix_cache_hit_share']:.0%} of prompt tokens")
    return result


def benchmark(bench: BenchModel, plan: Plan, *, dtype: str, server_threads: int, repeats: int, seed: int) -> dict:
    """Both servers, one after the other: {'cache_on', 'cache_off'} (best runs), 'measured' ratios."""
    adapters = bench.first_adapters(plan.num_adapters)
    results: dict = {"plan": plan.__dict__}
    for side, server in each_server(bench.base_dir, adapters, SIDES, dtype=dtype, server_threads=server_threads,
                                    max_running_requests=plan.concurrency):
        runs = [run_side(server.url, plan, tuple(adapters), seed + i, f"prefix cache: {side}, run {i + 1}")
                for i in range(repeats)]
        results[side] = best_of(runs)
        results[side]["best_ttft_p50_ms"] = best_of(runs, lambda r: r["summary"]["ttft_ms"]["p50"],
                                                    lower_is_better=True)["summary"]["ttft_ms"]["p50"]
    results["measured"] = measure_ratios(results)
    return results


def measure_ratios(results: dict) -> dict[str, tuple[float, str]]:
    on, off = results["cache_on"], results["cache_off"]
    on_tput, off_tput = (r["summary"]["output_token_throughput"] for r in (on, off))
    on_ttft, off_ttft = on["best_ttft_p50_ms"], off["best_ttft_p50_ms"]
    return {
        "prefix_throughput": versus(on_tput, off_tput, "out tok/s",
                                    note=f" ({on['prefix_cache_hit_share']:.0%} of prompt tokens hit)"),
        "prefix_ttft": versus(on_ttft, off_ttft, "ms", digits=0),
    }
