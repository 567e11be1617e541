"""Speculative decoding (n-gram) on / off: one stream and 8 streams, on a repetitive task and on open generation.

    python -m scripts.bench speculative                  # full: bench model, 1 and 8 streams, 128 output tokens
    python -m scripts.bench speculative --quick --json out.json

Repetitive: each prompt is a block of random tokens said three times over (the shape of "summarise / edit / quote
this text", where the output repeats the input); open: random prompt tokens. Greedy, ignore_eos, outputs of exact
length, on the base model and the plan's adapters (uniform). Two servers, started one after the other with the same
flags but `--speculative-config` (ngram, k tokens), run the same requests. Ratios: output throughput on / off per
workload and stream count; the notes carry the acceptance rate and mean accepted length from /server_info.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import scripts.bench.serving as bench_serving
from scripts.bench.model import BenchModel
from scripts.bench.report import Targets, best_of, versus
from scripts.bench.server import each_server
from scripts.bench.workload import DEFAULT_VOCAB_SIZE, FIRST_PLAIN_TOKEN_ID, BenchRequest


@dataclass(frozen=True)
class Plan:
    size: str
    num_adapters: int
    block_len: int  # repetitive prompts: a block of this many tokens, three times
    open_prompt_len: int
    output_len: int
    requests_per_stream: int
    num_speculative_tokens: int


FULL = Plan(size="full", num_adapters=2, block_len=64, open_prompt_len=192, output_len=128, requests_per_stream=4,
            num_speculative_tokens=4)
QUICK = Plan(size="quick", num_adapters=2, block_len=16, open_prompt_len=48, output_len=32, requests_per_stream=2,
             num_speculative_tokens=3)

WORKLOADS = ("repetitive", "open")
STREAMS = (1, 8)

TARGETS: Targets = {
    f"spec_{workload}_{streams}": (f"throughput, ngram speculation on / off, {workload} task, {streams} stream(s)",
                                   target, check)
    for workload, target, check in (("repetitive", ">= 1.2", lambda v: v >= 1.2),
                                    ("open", ">= 0.8", lambda v: v >= 0.8))
    for streams in STREAMS
}


def requests(plan: Plan, workload: str, streams: int, adapters: list[str | None], seed: int) -> list[BenchRequest]:
    rng = random.Random(f"{seed}-{workload}-{streams}")
    out = []
    for index in range(plan.requests_per_stream * streams):
        if workload == "repetitive":
            block = [rng.randrange(FIRST_PLAIN_TOKEN_ID, DEFAULT_VOCAB_SIZE) for _ in range(plan.block_len)]
            prompt = block * 3
        else:
            prompt = [rng.randrange(FIRST_PLAIN_TOKEN_ID, DEFAULT_VOCAB_SIZE) for _ in range(plan.open_prompt_len)]
        out.append(BenchRequest(index=index, input_ids=prompt, output_len=plan.output_len,
                                adapter=adapters[index % len(adapters)], arrival_s=0.0))  # fmt: skip
    return out


def spec_counts(url: str) -> tuple[int, int, int]:
    """(drafted, accepted, verify passes) so far, over every adapter."""
    info = asyncio.run(bench_serving.get_json(url, "/server_info"))["speculative"]
    return tuple(sum(a[key] for a in info["adapters"])
                 for key in ("num_draft_tokens", "num_accepted_tokens", "num_verify_passes"))  # type: ignore[return-value]


def benchmark(bench: BenchModel, plan: Plan, *, dtype: str, server_threads: int, repeats: int, seed: int) -> dict:
    adapter_dirs = bench.first_adapters(plan.num_adapters)
    adapters: list[str | None] = [None, *adapter_dirs]
    ngram = {"method": "ngram", "num_speculative_tokens": plan.num_speculative_tokens, "prompt_lookup_min": 1,
             "prompt_lookup_max": 4}
    sides = {"off": (), "ngram": ("--speculative-config", json.dumps(ngram))}
    results: dict = {"plan": plan.__dict__}
    for side, server in each_server(bench.base_dir, adapter_dirs, sides, dtype=dtype, server_threads=server_threads,
                                    max_running_requests=max(STREAMS)):
        for workload in WORKLOADS:
            for streams in STREAMS:
                before = spec_counts(server.url) if side == "ngram" else (0, 0, 0)
                runs = [bench_serving.run_and_report(server.url, requests(plan, workload, streams, adapters, seed + i),
                                                     streams, f"speculation {side}: {workload}, {streams} stream(s)")
                        for i in range(repeats)]  # fmt: skip
                best = best_of(runs)
                if side == "ngram":
                    after = spec_counts(server.url)
                    drafted, accepted, passes = (a - b for a, b in zip(after, before, strict=True))
                    best["acceptance_rate"] = accepted / max(1, drafted)
                    best["mean_accepted_length"] = 1 + accepted / max(1, passes)
                results[f"{side}_{workload}_{streams}"] = best
    results["measured"] = measure_ratios(results)
    return results


def measure_ratios(results: dict) -> dict[str, tuple[float, str]]:
    measured = {}
    for workload in WORKLOADS:
        for streams in STREAMS:
            on, off = results[f"ngram_{workload}_{streams}"], results[f"off_{workload}_{streams}"]
            note = (f" (acceptance {on['acceptance_rate']:.0%}, {on['mean_accepted_length']:.2f} tokens a verify "
                    "pass, warm-up included)")
            measured[f"spec_{workload}_{streams}"] = versus(on["summary"]["output_token_throughput"],
                                                            off["summary"]["output_token_throughput"], "out tok/s",
                                                            note=note)  # fmt: skip
    return measured
