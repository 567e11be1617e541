"""Model families beside the Llama rows: the same requests with 8 adapters and with none on a model of each family's
shape (scripts/bench/model.py SIZES), on this machine.

    python -m scripts.bench families                 # full: Qwen3- and Qwen3-MoE-shaped models, 64 requests
    python -m scripts.bench families --quick --json out.json

Per family, one server with 8 rank-16 all-module adapters (on a MoE: attention and every expert) preloaded runs the
workload on the 8 adapters (uniform), then the same requests on the base model alone, interleaved per repeat. Ratio:
output throughput 8 adapters / base (best of the repeats), as all.py's Llama row. A family is one entry of
FAMILY_SIZES.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import scripts.bench.serving as bench_serving
from scripts.bench.model import SIZES, BenchModel, ensure_bench_model
from scripts.bench.report import Targets, best_of, versus
from scripts.bench.server import start_server
from scripts.bench.workload import WorkloadSpec, make_workload

# family -> its bench model size in SIZES (full plan, quick plan)
FAMILY_SIZES: dict[str, tuple[str, str]] = {
    "qwen3": ("qwen3", "qwen3-quick"),
    "qwen3_moe": ("qwen3_moe", "qwen3_moe-quick"),
}


@dataclass(frozen=True)
class Plan:
    size: str  # the first family's (what scripts/bench/ratios.py builds); each family builds its own below
    quick: bool
    num_adapters: int
    input_len_range: tuple[int, int]
    output_len_range: tuple[int, int]
    num_requests: int
    concurrency: int
    families: tuple[str, ...] = field(default=tuple(FAMILY_SIZES))

    def family_size(self, family: str) -> str:
        return FAMILY_SIZES[family][1 if self.quick else 0]


FULL = Plan(size=FAMILY_SIZES["qwen3"][0], quick=False, num_adapters=8, input_len_range=(16, 128),
            output_len_range=(16, 128), num_requests=64, concurrency=16)
QUICK = Plan(size=FAMILY_SIZES["qwen3"][1], quick=True, num_adapters=8, input_len_range=(8, 16),
             output_len_range=(4, 8), num_requests=16, concurrency=8)


TARGETS: Targets = {
    f"{family}_multi_vs_base": (f"{family}-shaped: {{num_adapters}}-adapter / base-only throughput "
                                "({concurrency} concurrent)", ">= 0.8", lambda v: v >= 0.8)
    for family in FAMILY_SIZES
}


def benchmark(bench: BenchModel, plan: Plan, *, dtype: str, server_threads: int, repeats: int, seed: int) -> dict:
    """Per family: {'size', 'adapters', 'base'} (best runs); 'measured' ratios. Each family's bench model is built
    beside `bench` (in the same cache directory)."""
    cache_dir = bench.base_dir.parent.parent
    results: dict = {"plan": {**plan.__dict__, "families": list(plan.families)}, "families": {}}
    for family in plan.families:
        size = plan.family_size(family)
        model = ensure_bench_model(SIZES[size], plan.num_adapters, cache_dir)
        adapters = WorkloadSpec(num_requests=plan.num_requests, input_len_range=plan.input_len_range,
                                output_len_range=plan.output_len_range, adapter_names=tuple(model.adapter_dirs),
                                seed=seed)
        base = replace(adapters, adapter_names=())
        runs: dict[str, list[dict]] = {"adapters": [], "base": []}
        with start_server(model.base_dir, model.adapter_dirs, dtype=dtype, server_threads=server_threads,
                          max_running_requests=plan.concurrency, max_loras_per_batch=plan.num_adapters) as server:
            for i in range(repeats):  # interleaved, so that a slow spell of the machine hits both sides alike
                for side, spec in (("adapters", adapters), ("base", base)):
                    label = f"{plan.num_adapters} adapters" if spec.adapter_names else "base"
                    desc = f"{family} ({SIZES[size].key}), {label}, run {i + 1}"
                    runs[side].append(bench_serving.run_and_report(server.url, make_workload(spec),
                                                                   plan.concurrency, desc))
        results["families"][family] = {"size": SIZES[size].key, **{side: best_of(r) for side, r in runs.items()}}
    results["measured"] = measure_ratios(results)
    return results


def measure_ratios(results: dict) -> dict[str, tuple[float, str]]:
    measured = {}
    for family, runs in results["families"].items():
        multi, base = (runs[side]["summary"]["output_token_throughput"] for side in ("adapters", "base"))
        measured[f"{family}_multi_vs_base"] = versus(multi, base, "out tok/s", note=f" ({runs['size']})")
    return measured
