"""Every benchmark on one workload, servers started and stopped here, and one table of the ratios the issue targets.

    python -m scripts.bench.all                 # full: 137 M params, 128 requests, bf16, ~25 min on 2 cores (est.)
    python -m scripts.bench.all --quick         # a small model and a short workload: a smoke run of ~2 minutes
    python -m scripts.bench.all --dtype float32 --repeats 2 --json out.json   # fp32, best of two runs per workload

Order: build (or reuse) the bench model; the PEFT baseline in this process (no server running); then one server
with all the workload's adapters preloaded runs the 32-adapter workload, the same workload with 8 adapters and
with none, one stream against the same forward step in this process (step_overhead.py), and the adapter
load/unload benchmark (an extra adapter, not in the workload). Then the engine-core benchmarks (rows of
ratios.py), each starting its own servers: prefix cache on / off (prefix_cache.py), chunked / whole prefill
(chunked_prefill.py), chats without max_tokens in a fixed KV cache (kv_admission.py), a quarter of the requests under
a JSON schema against none (structured.py), `--dp-size 2` against one replica on the same cores (dp.py), 8 adapters
against the base on a model of each other family's shape (families.py: Qwen3, Qwen3-MoE; with a hybrid model's decode
step against a dense one's and latent attention's KV bytes per token against plain attention's), and decode (one
stream, and one request per adapter on 32 adapters) on INT8 and INT4 copies of the bench model against its plain
weights, in process (quantized.py). Every ratio's two sides are measured in this run, on this machine. Both systems
run in the same dtype (bfloat16 by default: on a CPU with AMX/AVX512-BF16 its matmuls are 3-6x faster than float32)
and with one thread per core.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import scripts.bench.adapter_ops as bench_adapter_ops
import scripts.bench.peft_baseline as bench_peft_baseline
import scripts.bench.serving as bench_serving
import scripts.bench.step_overhead as bench_step_overhead
from scripts.bench import ratios
from scripts.bench.model import SIZES, adapter_name, ensure_bench_model
from scripts.bench.report import (
    RATIO_HEADERS,
    SUMMARY_HEADERS,
    Targets,
    best_of,
    format_table,
    ratio_rows,
    summary_rows,
    versus,
    write_json,
)
from scripts.bench.server import add_server_args, start_server
from scripts.bench.workload import WorkloadSpec, make_workload


@dataclass(frozen=True)
class Plan:
    size: str
    num_requests: int
    input_len_range: tuple[int, int]
    output_len_range: tuple[int, int]
    num_adapters: int  # the multi-adapter workload; the "8-adapter" one uses min(8, this)
    concurrency: int
    ops_cycles: int
    ops_duration_s: float
    ops_settle_s: float
    ops_per_second: float
    stream_concurrency: int
    stream_output_len: int


FULL = Plan(size="full", num_requests=128, input_len_range=(16, 256), output_len_range=(16, 256), num_adapters=32,
            concurrency=32, ops_cycles=20, ops_duration_s=60.0, ops_settle_s=3.0, ops_per_second=2.0,
            stream_concurrency=8, stream_output_len=128)
QUICK = Plan(size="quick", num_requests=32, input_len_range=(8, 32), output_len_range=(8, 32), num_adapters=32,
             concurrency=32, ops_cycles=5, ops_duration_s=5.0, ops_settle_s=1.0, ops_per_second=2.0,
             stream_concurrency=8, stream_output_len=32)

TARGETS: Targets = {
    "peft": ("loraplex / peft throughput ({n} adapters uniform, {c} concurrent)", ">= 5", lambda v: v >= 5),
    "multi_vs_base": ("{k}-adapter / base-only throughput (same server, same requests)", ">= 0.8",
                      lambda v: v >= 0.8),
    "load_idle": ("adapter load / file read (idle, p50)", "<= 3", lambda v: v <= 3),
    "load_busy": ("adapter load / (file read + one decode step) (decoding, p50)", "<= 1", lambda v: v <= 1),
    "itl_storm": ("ITL p99 storm / quiet ({ops:g} ops/s)", "<= 1.5", lambda v: v <= 1.5),
}


# The engine-core benchmarks that start servers of their own, in the order they run (after the main server's).
# results key -> its row of scripts/bench/ratios.py
ENGINE_BENCHMARKS = {"prefix_cache": "prefix_cache", "chunked_prefill": "chunked_prefill",
                     "kv_admission": "kv_admission", "structured": "structured", "data_parallel": "dp",
                     "families": "families", "quantized": "quantized"}


def cpu_speed_gflops(duration_s: float = 0.5) -> float:
    """A batch-32 decode-shaped GEMM on this process's threads: read next to each phase, it shows whether the
    machine was as fast for one side of a ratio as for the other (other tenants, throttling)."""
    import torch

    x, w = torch.randn(32, 1024), torch.randn(2816, 1024)
    for _ in range(10):
        x @ w.T
    num_iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < duration_s:
        x @ w.T
        num_iters += 1
    return num_iters * 2 * x.shape[0] * w.shape[0] * w.shape[1] / (time.perf_counter() - start) / 1e9


def run_peft(base_dir: Path, adapter_dirs: dict[str, Path], spec: WorkloadSpec, plan: Plan, repeats: int,
             num_threads: int | None, dtype: str) -> dict:
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
    model = bench_peft_baseline.load_peft_model(base_dir, {n: adapter_dirs[n] for n in spec.adapter_names}, dtype)
    try:
        return best_of([bench_peft_baseline.run_baseline(model, make_workload(spec), plan.concurrency,
                                                         use_adapters=True) for _ in range(repeats)])
    finally:
        del model
        gc.collect()


def run_serving(url: str, spec: WorkloadSpec, plan: Plan, desc: str) -> dict:
    return bench_serving.run_and_report(url, make_workload(spec), plan.concurrency, desc, title=f"loraplex, {desc}")


def measure_ratios(results: dict) -> dict[str, tuple[float, str]]:
    """key -> (ratio, its two sides in words), both sides from this run's results."""
    peft = results["peft"]["summary"]["output_token_throughput"]
    multi = results["serving_many"]["summary"]["output_token_throughput"]
    few = results["serving_few"]["summary"]["output_token_throughput"]
    base = results["serving_base"]["summary"]["output_token_throughput"]
    ops = results["adapter_ops"]
    read, step = ops["idle"]["read_ms"]["p50"], ops["quiet"]["itl_ms"]["p50"]
    idle_load, busy_load = ops["idle"]["load_ms"]["p50"], ops["storm"]["load_ms"]["p50"]
    storm_p99, quiet_p99 = ops["storm"]["itl_ms"]["p99"], ops["quiet"]["itl_ms"]["p99"]
    return {
        "peft": versus(multi, peft, "out tok/s"),
        "multi_vs_base": versus(few, base, "out tok/s"),
        "load_idle": versus(idle_load, read, "ms"),
        "load_busy": (busy_load / (read + step), f"{busy_load:.1f} vs {read:.1f} + {step:.1f} ms"),
        "itl_storm": versus(storm_p99, quiet_p99, "ms"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(parser)
    parser.add_argument("--num-requests", type=int, default=None, help="override the plan's request count")
    parser.add_argument("--input-len-range", type=int, nargs=2, default=None, metavar=("LOW", "HIGH"))
    parser.add_argument("--output-len-range", type=int, nargs=2, default=None, metavar=("LOW", "HIGH"))
    parser.add_argument("--ops-duration", type=float, default=None, help="override the quiet/storm window seconds")
    parser.add_argument("--peft-threads", type=int, default=None, help="torch threads of the PEFT baseline "
                        "(default: torch's, one per core)")
    parser.add_argument("--skip-engine", action="store_true",
                        help="leave out the engine-core benchmarks that start servers of their own (prefix cache, "
                        "chunked prefill, KV admission)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.num_requests:
        plan = replace(plan, num_requests=args.num_requests)
    if args.input_len_range:
        plan = replace(plan, input_len_range=tuple(args.input_len_range))
    if args.output_len_range:
        plan = replace(plan, output_len_range=tuple(args.output_len_range))
    if args.ops_duration:
        plan = replace(plan, ops_duration_s=args.ops_duration)
    started = time.time()
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        print(f"note: 1-minute load average {load_before[0]:.1f} before start: other processes share the CPUs, "
              "and every ratio below is only as steady as they are", flush=True)

    bench = ensure_bench_model(SIZES[plan.size], plan.num_adapters + 1, args.cache_dir)
    ops_adapter_dir = bench.adapter_dirs.pop(adapter_name(plan.num_adapters))  # never preloaded
    num_few = min(8, plan.num_adapters)
    many = WorkloadSpec(num_requests=plan.num_requests, input_len_range=plan.input_len_range,
                        output_len_range=plan.output_len_range, adapter_names=tuple(bench.adapter_dirs),
                        seed=args.seed)
    few = replace(many, adapter_names=many.adapter_names[:num_few])
    base = replace(many, adapter_names=())

    results: dict = {"plan": plan.__dict__, "dtype": args.dtype, "workload": many.to_json(), "cpu_gflops": {}}
    results["cpu_gflops"]["before_peft"] = cpu_speed_gflops()
    print(f"== peft baseline: {plan.num_requests} requests, static batches of {plan.concurrency}", flush=True)
    results["peft"] = run_peft(bench.base_dir, bench.adapter_dirs, many, plan, args.repeats, args.peft_threads,
                               args.dtype)
    print(format_table(SUMMARY_HEADERS, summary_rows("peft", results["peft"]["summary"])))

    results["cpu_gflops"]["before_serving"] = cpu_speed_gflops()
    results["server_threads"] = args.server_threads or "server default"
    engine_plans = {name: ratios.module(name).QUICK if args.quick else ratios.module(name).FULL
                    for name in ("step_overhead", *ENGINE_BENCHMARKS.values())}
    with start_server(bench.base_dir, bench.adapter_dirs, dtype=args.dtype, server_threads=args.server_threads,
                      max_running_requests=plan.concurrency,
                      max_loras_per_batch=max(8, plan.num_adapters)) as server:
        results["server_log"] = server.log_path
        runs: dict[str, list[dict]] = {"serving_many": [], "serving_few": [], "serving_base": []}
        for _ in range(args.repeats):  # interleaved, so that a slow spell of the machine hits every workload alike
            runs["serving_many"].append(run_serving(server.url, many, plan, f"{plan.num_adapters} adapters uniform"))
            runs["serving_few"].append(run_serving(server.url, few, plan, f"{num_few} adapters uniform"))
            runs["serving_base"].append(run_serving(server.url, base, plan, "base only"))
        results.update({key: best_of(key_runs) for key, key_runs in runs.items()})
        print(f"\n== one stream against the in-process forward step, best of {args.repeats}", flush=True)
        results["step_overhead"] = bench_step_overhead.benchmark_on(
            server.url, bench, engine_plans["step_overhead"], dtype=args.dtype,
            server_threads=args.server_threads, repeats=args.repeats, seed=args.seed)
        print(f"\n== adapter ops: {plan.ops_cycles} idle cycles, {plan.ops_duration_s:g} s quiet + "
              f"{plan.ops_duration_s:g} s storm", flush=True)
        results["adapter_ops"] = asyncio.run(bench_adapter_ops.benchmark(
            server.url, ops_adapter_dir, cycles=plan.ops_cycles, ops_per_second=plan.ops_per_second,
            duration_s=plan.ops_duration_s, settle_s=plan.ops_settle_s, stream_concurrency=plan.stream_concurrency,
            stream_adapters=list(many.adapter_names[:plan.stream_concurrency]),
            output_len=plan.stream_output_len, seed=args.seed))
        bench_adapter_ops.print_report(results["adapter_ops"])

    own_servers = {} if args.skip_engine else ENGINE_BENCHMARKS
    for key, name in own_servers.items():
        module = ratios.module(name)
        results["cpu_gflops"][f"before_{key}"] = cpu_speed_gflops()
        print(f"\n== {key}: {module.__doc__.splitlines()[0]}", flush=True)
        results[key] = module.benchmark(bench, engine_plans[name], dtype=args.dtype,
                                        server_threads=args.server_threads, repeats=args.repeats, seed=args.seed)

    results["cpu_gflops"]["at_end"] = cpu_speed_gflops()
    measured = measure_ratios(results)
    rows = ratio_rows(TARGETS, measured, n=plan.num_adapters, c=plan.concurrency, k=num_few, ops=plan.ops_per_second)
    for key, name in {"step_overhead": "step_overhead", **own_servers}.items():
        rows += ratios.rows(name, results[key])
        measured.update(results[key]["measured"])
    results["ratios"] = {key: value for key, (value, _) in measured.items()}
    results["load_average"] = {"before": load_before, "after": os.getloadavg()}
    print(f"\nbench_all ({plan.size} model {SIZES[plan.size].key}, {plan.num_requests} requests, "
          f"in {plan.input_len_range[0]}-{plan.input_len_range[1]}, out {plan.output_len_range[0]}-"
          f"{plan.output_len_range[1]} tokens; {args.dtype}; best of {args.repeats}; peft threads "
          f"{results['peft']['num_threads']}, server threads {results['server_threads']}; "
          f"{time.time() - started:.0f} s; load avg "
          f"{load_before[0]:.1f} -> {results['load_average']['after'][0]:.1f}; CPU probe GFLOP/s "
          f"{', '.join(f'{key} {value:.0f}' for key, value in results['cpu_gflops'].items())})")
    print(format_table(RATIO_HEADERS, rows))
    if args.json:
        write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
