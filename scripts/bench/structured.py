"""Structured output's cost: throughput with a quarter of the requests held to a JSON schema, against none.

    python -m scripts.bench structured                 # full: 64 requests, 16 concurrent, 4 adapters
    python -m scripts.bench structured --quick --json out.json

One server runs the same requests (prompts, lengths, adapters: workload.py's seeded list) twice per repeat,
interleaved: every request free (greedy, ignore_eos), then every 4th request under a JSON schema (an object holding
an array of at least 1,000 strings of 4-12 characters, so the grammar cannot end before max_new_tokens and every
request writes exactly its output length on both sides). The grammar is compiled by a warm-up request first. Ratio:
output throughput (tokens / wall time of the run) constrained / free, best of the repeats each.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import scripts.bench.serving as bench_serving
from scripts.bench.model import BenchModel
from scripts.bench.report import Targets, best_of, versus
from scripts.bench.server import start_server
from scripts.bench.workload import BenchRequest, WorkloadSpec, make_workload

SCHEMA = json.dumps({
    "type": "object",
    "properties": {"notes": {"type": "array", "minItems": 1000,
                             "items": {"type": "string", "minLength": 4, "maxLength": 12}}},
    "required": ["notes"],
})


@dataclass(frozen=True)
class Plan:
    size: str
    num_adapters: int
    num_requests: int
    input_len_range: tuple[int, int]
    output_len_range: tuple[int, int]
    concurrency: int
    constrained_every: int  # every n-th request is constrained: 4 = 25 %

    def spec(self, adapter_names: tuple[str, ...], seed: int) -> WorkloadSpec:
        return WorkloadSpec(num_requests=self.num_requests, input_len_range=self.input_len_range,
                            output_len_range=self.output_len_range, adapter_names=adapter_names, seed=seed)


FULL = Plan(size="full", num_adapters=4, num_requests=64, input_len_range=(32, 64), output_len_range=(64, 128),
            concurrency=16, constrained_every=4)
QUICK = Plan(size="quick", num_adapters=2, num_requests=16, input_len_range=(8, 16), output_len_range=(8, 16),
             concurrency=8, constrained_every=4)

TARGETS: Targets = {
    "structured_throughput": ("throughput, 1 in {constrained_every} requests under a JSON schema / none "
                              "({num_requests} requests, {concurrency} concurrent)", ">= 0.8", lambda v: v >= 0.8),
}


def payload(request: BenchRequest, constrained: bool) -> dict:
    sampling: dict = {"max_new_tokens": request.output_len, "temperature": 0.0}
    if constrained:
        sampling["json_schema"] = SCHEMA  # the grammar forbids eos until it is complete: the length is exact
    else:
        sampling["ignore_eos"] = True
    return {"input_ids": request.input_ids, "sampling_params": sampling, "lora_path": request.adapter}


async def run(url: str, requests: list[BenchRequest], plan: Plan, constrained: bool) -> dict:
    """All requests, at most `concurrency` in flight: {'summary': output tokens, seconds, throughput}."""
    limit = asyncio.Semaphore(plan.concurrency)
    async with bench_serving.client_session(plan.concurrency) as session:

        async def one(request: BenchRequest) -> int:
            is_constrained = constrained and request.index % plan.constrained_every == 0
            async with limit, session.post(url + "/generate", json=payload(request, is_constrained)) as resp:
                body = await resp.json()
            if resp.status != 200:
                raise SystemExit(f"request {request.index} failed: HTTP {resp.status}: {body}")
            if len(body["output_ids"]) != request.output_len:
                raise SystemExit(f"request {request.index}: {len(body['output_ids'])} tokens, not "
                                 f"{request.output_len} (finish {body['meta_info']['finish_reason']})")
            return len(body["output_ids"])

        start = time.perf_counter()
        num_tokens = sum(await asyncio.gather(*(one(r) for r in requests)))
        duration_s = time.perf_counter() - start
    summary = {"num_output_tokens": num_tokens, "duration_s": duration_s,
               "output_token_throughput": num_tokens / duration_s}
    return {"summary": summary}


def benchmark(bench: BenchModel, plan: Plan, *, dtype: str, server_threads: int, repeats: int, seed: int) -> dict:
    """One server; free and constrained runs interleaved: {'free', 'constrained'} (best runs), 'measured' ratios."""
    adapters = bench.first_adapters(plan.num_adapters)
    requests = make_workload(plan.spec(tuple(adapters), seed))
    runs: dict[str, list[dict]] = {"free": [], "constrained": []}
    with start_server(bench.base_dir, adapters, dtype=dtype, server_threads=server_threads,
                      max_running_requests=plan.concurrency, max_loras_per_batch=plan.num_adapters) as server:
        warm = [BenchRequest(0, r.input_ids[::-1], 4, r.adapter, 0.0) for r in requests[:plan.num_adapters]]
        asyncio.run(run(server.url, warm, plan, constrained=True))  # adapters into slots, the grammar compiled
        for i in range(repeats):
            for side in list(runs)[:: 1 if i % 2 == 0 else -1]:  # each side goes first in turn
                result = asyncio.run(run(server.url, requests, plan, constrained=side == "constrained"))
                s = result["summary"]
                print(f"structured output: {side}, run {i + 1}: {s['num_output_tokens']} tokens in "
                      f"{s['duration_s']:.1f} s = {s['output_token_throughput']:.1f} out tok/s", flush=True)
                runs[side].append(result)
    results: dict = {"plan": plan.__dict__, **{side: best_of(side_runs) for side, side_runs in runs.items()}}
    results["measured"] = measure_ratios(results)
    return results


def measure_ratios(results: dict) -> dict[str, tuple[float, str]]:
    constrained, free = (results[side]["summary"]["output_token_throughput"] for side in ("constrained", "free"))
    return {"structured_throughput": versus(constrained, free, "out tok/s")}
