"""The ratio benchmarks, one table: each measures both sides of its ratios in the same run, on this machine, and prints
them as rows of ratio / measured / target / met / from.

    python -m scripts.bench prefix_cache                     # the full plan
    python -m scripts.bench prefix_cache --quick --json out.json

A row of RATIO_BENCHMARKS names the module that measures: its FULL and QUICK plans (each with the bench model `size`
it runs), TARGETS (labels may name the plan's fields), and `benchmark(bench, plan, *, dtype, server_threads, repeats,
seed)`, which returns its results with 'measured' = {target key: (ratio, its two sides in words)} and 'plan'. The
flags, the bench model, the table and --json are the same for every row, here; bench/all.py runs the same
`benchmark` functions after its own server's workloads. A module may also have options of its own
(`add_arguments(parser)`, returning their dests, which reach `benchmark` as keywords) and OPTIONAL_TARGETS, rows the
table shows when they were measured (an option ran them).
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

from scripts.bench.model import SIZES, ensure_bench_model
from scripts.bench.report import RATIO_HEADERS, format_table, ratio_rows, write_json
from scripts.bench.server import add_server_args

# name (the command's argument and the module under scripts/bench/) -> what it compares
RATIO_BENCHMARKS: dict[str, str] = {
    "prefix_cache": "the prefix cache on shared system prompts, on / off",
    "chunked_prefill": "the streams' ITL while long prompts arrive, chunked / whole prefill",
    "kv_admission": "chats without max_tokens running at once in a fixed KV cache / the reserve-everything rule",
    "structured": "throughput with a quarter of the requests under a JSON schema / none",
    "dp": "throughput, --dp-size 2 / one replica on the same cores",
    "families": "throughput, 8 adapters / the base, on a model of each other family's shape",
    "quantized": "decode step, plain / INT8 and INT4 bases, in process",
    "fairness": "cold adapters' TTFT and throughput under a hot adapter, fair / unfair admission",
    "step_overhead": "one stream's ITL through the server / the same forward step in process",
    "speculative": "throughput on the trained demo, n-gram / draft model / none, 1 and 8 streams, two workloads "
                   "(--llama-cpp DIR: beside llama-server's own)",
}


def module(name: str) -> ModuleType:
    return importlib.import_module(f"scripts.bench.{name}")


def rows(name: str, results: dict) -> list[list[str]]:
    bench_module = module(name)
    optional = {key: target for key, target in getattr(bench_module, "OPTIONAL_TARGETS", {}).items()
                if key in results["measured"]}  # fmt: skip
    return ratio_rows({**bench_module.TARGETS, **optional}, results["measured"], **results.get("plan", {}))


def main(name: str, argv: list[str] | None = None) -> dict:
    bench_module = module(name)
    parser = argparse.ArgumentParser(prog=f"python -m scripts.bench {name}",
                                     description=bench_module.__doc__.split("\n\n")[0])
    add_server_args(parser)
    own = bench_module.add_arguments(parser) if hasattr(bench_module, "add_arguments") else []
    args = parser.parse_args(argv)
    plan = bench_module.QUICK if args.quick else bench_module.FULL
    # a benchmark on another model (USES_BENCH_MODEL False: speculative's trained demo) gets none
    uses_bench = getattr(bench_module, "USES_BENCH_MODEL", True)
    bench = ensure_bench_model(SIZES[plan.size], plan.num_adapters, args.cache_dir) if uses_bench else None
    options = {dest: getattr(args, dest) for dest in own}
    results = bench_module.benchmark(bench, plan, dtype=args.dtype, server_threads=args.server_threads,
                                     repeats=args.repeats, seed=args.seed, **options)
    print(format_table(RATIO_HEADERS, rows(name, results)))
    if args.json:
        write_json(args.json, results)
    return results
