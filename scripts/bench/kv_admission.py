"""How many chat requests without max_tokens run at once in a fixed KV cache, against the old reserve-everything rule.

    python -m scripts.bench kv_admission                  # full: 64 chats, --max-total-tokens 8192
    python -m scripts.bench kv_admission --quick --json out.json

A chat request without max_tokens may write up to the context length. Reserving that much for each request (the rule
before pages on demand) runs at most floor(max_total_tokens / context_length) at once; the scheduler now gives a
request pages only for the tokens it has and preempts the newest when they run out. `--num-chats` streamed
/v1/chat/completions requests (no max_tokens, ignore_eos, round robin over the adapters) run for `--window` seconds
on a server with `--max-total-tokens` fixed, while /server_info's num_running is sampled every 0.1 s; then they are
cut off. Ratio: the peak of num_running / floor(max_total_tokens / context_length), the context length being what the
server reports.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

import scripts.bench.serving as bench_serving
from scripts.bench.model import BenchModel
from scripts.bench.report import Targets, best_of
from scripts.bench.server import start_server


@dataclass(frozen=True)
class Plan:
    size: str
    num_adapters: int
    num_chats: int  # in flight at once; also --max-running-requests
    max_total_tokens: int
    window_s: float


FULL = Plan(size="full", num_adapters=8, num_chats=64, max_total_tokens=8192, window_s=30.0)
QUICK = Plan(size="quick", num_adapters=2, num_chats=32, max_total_tokens=4096, window_s=3.0)

TARGETS: Targets = {
    "kv_admission": ("peak running chats without max_tokens / floor(max_total_tokens / context_length) "
                     "(--max-total-tokens {max_total_tokens}, {num_chats} chats)", ">= 4", lambda v: v >= 4),
}


async def chat_until_cancelled(session: aiohttp.ClientSession, url: str, model: str, text: str) -> int:
    """One streamed chat without max_tokens; the chunks it got when cancelled (or when it ended)."""
    body = {"model": model, "messages": [{"role": "user", "content": text}],
            "stream": True, "ignore_eos": True, "temperature": 0.0}
    num_chunks = 0
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"chat {text!r}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if line.startswith(bench_serving.SSE_PREFIX):
                num_chunks += 1
    return num_chunks


async def run_once(url: str, plan: Plan, adapters: list[str], seed: int) -> dict:
    stop = asyncio.Event()
    sampler = asyncio.create_task(bench_serving.sample_server_info(url, stop))
    async with bench_serving.client_session(plan.num_chats) as session:
        chats = [asyncio.create_task(chat_until_cancelled(session, url, adapters[i % len(adapters)],
                                                          f"Tell me a long story, number {seed}-{i}."))
                 for i in range(plan.num_chats)]
        done, _ = await asyncio.wait(chats, timeout=plan.window_s)
        for task in chats:  # cut off: the server aborts what the client leaves
            task.cancel()
        results = await asyncio.gather(*chats, return_exceptions=True)
    # Every chat runs past the window (ignore_eos, up to the context length), so one that ended in it failed.
    errors = [r for r in results if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError)]
    if errors or done:
        raise RuntimeError(f"{len(errors) or len(done)} chats ended inside the window; first: "
                           f"{errors[0] if errors else next(iter(done)).result()} chunks")
    stop.set()
    samples = await sampler
    info = await bench_serving.get_json(url, "/server_info")
    deadline = time.perf_counter() + 30
    while info["num_running"] + info["num_waiting"] and time.perf_counter() < deadline:  # the aborts land
        await asyncio.sleep(0.1)
        info = await bench_serving.get_json(url, "/server_info")
    running = [s["num_running"] for s in samples if s["num_running"] is not None]
    return {"peak_running": max(running), "running_at_end": running[-1], "num_samples": len(running),
            "num_preemptions": info["num_preemptions"], "peak_kv_usage": max(s["kv_usage"] or 0 for s in samples),
            "context_length": info["context_length"], "max_total_tokens": info["max_total_tokens"],
            "left_running_after_abort": info["num_running"] + info["num_waiting"]}


def benchmark(bench: BenchModel, plan: Plan, *, dtype: str, server_threads: int, repeats: int, seed: int) -> dict:
    adapter_dirs = bench.first_adapters(plan.num_adapters)
    adapters = list(adapter_dirs)
    with start_server(bench.base_dir, adapter_dirs, dtype=dtype,
                      server_threads=server_threads, max_running_requests=plan.num_chats,
                      max_loras_per_batch=plan.num_adapters,
                      extra=("--max-total-tokens", str(plan.max_total_tokens))) as server:
        runs = []
        for i in range(repeats):
            run = asyncio.run(run_once(server.url, plan, adapters, seed + i))
            print(f"== kv admission, run {i + 1}: peak running {run['peak_running']} of {plan.num_chats} chats, "
                  f"{run['running_at_end']} at the end of {plan.window_s:g} s, {run['num_preemptions']} preemptions "
                  f"so far, peak KV usage {run['peak_kv_usage']:.0%}", flush=True)
            runs.append(run)
    results: dict = {"plan": plan.__dict__, "best": best_of(runs, lambda r: r["peak_running"])}
    results["measured"] = measure_ratios(results)
    return results


def measure_ratios(results: dict) -> dict[str, tuple[float, str]]:
    best = results["best"]
    old_rule = best["max_total_tokens"] // best["context_length"]
    return {"kv_admission": (best["peak_running"] / old_rule if old_rule else float("inf"),
                             f"{best['peak_running']} vs {best['max_total_tokens']} // {best['context_length']} = "
                             f"{old_rule} running")}
