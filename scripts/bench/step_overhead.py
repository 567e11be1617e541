"""What the server adds to a decode step: one stream's ITL through HTTP against the same forward step in process.

    python -m scripts.bench step_overhead                 # full: the bench model, 32 adapters preloaded
    python -m scripts.bench step_overhead --quick --json out.json

One request (32-token prompt, 256 tokens out, on one adapter) streams through a server started as bench_all starts
its own; its ITL p50 is a whole step of the server: scheduling, the ZeroMQ hops, the forward with sampling,
detokenizing, the HTTP chunk. The same forward runs in this process (scripts/bench/decode_step.py's ModelRunner,
batch 1, the adapter in slot 0, the stream's mean context, as many LoRA slots as the server, at the server worker's
thread count) with the server idle; its median step is what the server cannot beat. Ratio: ITL p50 / step median
(each the best of the repeats; the two alternate).
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass

import torch
from loraplex.worker.model_runner import ModelRunner

import scripts.bench.serving as bench_serving
from scripts.bench.decode_step import decode_reqs, make_runner, step_ms
from scripts.bench.model import BenchModel
from scripts.bench.report import Targets, best_of, versus
from scripts.bench.server import start_server, worker_threads
from scripts.bench.workload import WorkloadSpec, make_workload

NUM_WARMUP_STEPS = 4


@dataclass(frozen=True)
class Plan:
    size: str
    num_adapters: int  # preloaded on a server this script starts (all.py passes its own server)
    prompt_len: int
    output_len: int
    num_steps: int  # timed in-process steps per repeat


FULL = Plan(size="full", num_adapters=32, prompt_len=32, output_len=256, num_steps=64)
QUICK = Plan(size="quick", num_adapters=8, prompt_len=32, output_len=128, num_steps=32)

TARGETS: Targets = {
    "step_overhead": ("one stream's ITL p50 through the server / in-process forward step at batch 1 "
                      "({output_len} tokens out, one adapter)", "<= 1.15", lambda v: v <= 1.15),
}


def in_process_step_ms(runner: ModelRunner, pages: list[list[int]], context: int, num_steps: int) -> float:
    """Median of num_steps decode steps of the one request (adapter in slot 0)."""
    reqs = decode_reqs(pages, context, [0])
    times = [step_ms(runner, reqs, step) for step in range(NUM_WARMUP_STEPS + num_steps)]
    return statistics.median(times[NUM_WARMUP_STEPS:])


def benchmark_on(url: str, bench: BenchModel, plan: Plan, *, dtype: str, server_threads: int, repeats: int,
                 seed: int) -> dict:
    """On a running server with bench's adapters loaded: the stream and the in-process step, alternating."""
    info = asyncio.run(bench_serving.get_json(url, "/server_info"))
    adapter = next(iter(bench.adapter_dirs))
    [request] = make_workload(WorkloadSpec(num_requests=1, input_len_range=(plan.prompt_len,) * 2,
                                           output_len_range=(plan.output_len,) * 2, adapter_names=(adapter,),
                                           seed=seed))
    context = plan.prompt_len + plan.output_len // 2
    threads_before = torch.get_num_threads()
    torch.set_num_threads(worker_threads(server_threads))
    try:
        runner, pages = make_runner(bench, dtype=dtype, batch=1, context=context,
                                    max_loras_per_batch=info["max_loras_per_batch"], num_adapters=1)
        streams, steps = [], []
        for i in range(repeats):
            streams.append(asyncio.run(bench_serving.benchmark(url, [request], concurrency=1, progress=False)))
            steps.append(in_process_step_ms(runner, pages, context, plan.num_steps))
            print(f"== one stream, run {i + 1}: ITL p50 {streams[-1]['summary']['itl_ms']['p50']:.2f} ms; "
                  f"in-process step median {steps[-1]:.2f} ms ({torch.get_num_threads()} threads)", flush=True)
        del runner
    finally:
        torch.set_num_threads(threads_before)
    stream = best_of(streams, lambda r: r["summary"]["itl_ms"]["p50"], lower_is_better=True)
    results: dict = {"plan": plan.__dict__, "stream": stream["summary"], "all_stream_itl_p50_ms":
                     stream["all_runs_metric"], "step_ms": min(steps), "all_step_ms": steps,
                     "threads": worker_threads(server_threads), "context": context}
    results["measured"] = measure_ratios(results)
    return results


def measure_ratios(results: dict) -> dict[str, tuple[float, str]]:
    itl, step = results["stream"]["itl_ms"]["p50"], results["step_ms"]
    return {"step_overhead": versus(itl, step, "ms", digits=2, note=f" ({results['threads']} threads)")}


def benchmark(bench: BenchModel, plan: Plan, *, dtype: str, server_threads: int, repeats: int, seed: int) -> dict:
    """On a server of its own (all.py runs benchmark_on against its main server)."""
    with start_server(bench.base_dir, bench.adapter_dirs, dtype=dtype, server_threads=server_threads,
                      max_running_requests=32, max_loras_per_batch=max(8, plan.num_adapters)) as server:
        return benchmark_on(server.url, bench, plan, dtype=dtype, server_threads=server_threads, repeats=repeats,
                            seed=seed)
