"""Load generator for a running loraplex server: many adapters, Poisson or closed-loop arrivals, streamed /generate.

    python -m scripts.bench.serving --url http://127.0.0.1:30000 --num-adapters 32 --concurrency 32 \
        --num-requests 256 --input-len-range 16 256 --output-len-range 16 256 --json out.json

Requests use random prompt ids and ignore_eos, so every output has exactly its requested length. TTFT is the time
from sending to the first streamed token; ITL is the gap between consecutive streamed tokens (a chunk that brings
k tokens counts as k gaps of 1/k of its delay each, as SGLang's bench_serving does). Throughputs are over the run's
wall time, first request sent to last token received. Adapters must already be loaded on the server; one short
request per adapter (and base) goes first, unmeasured, so an adapter's first trip into a device slot is not timed.
For the benchmarks built on it: `steady_stream` keeps a closed loop of decoding streams until told to stop
(`gaps_between` reads its ITL by window), and `sample_server_info` samples /server_info while a run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import aiohttp

from scripts.bench.report import (
    SUMMARY_HEADERS,
    RequestResult,
    format_table,
    summarize,
    summarize_per_adapter,
    summary_rows,
    write_json,
)
from scripts.bench.workload import (
    BenchRequest,
    WorkloadSpec,
    add_workload_args,
    make_workload,
    workload_spec_from_args,
)

SSE_PREFIX = b"data: "


@dataclass(frozen=True)
class Wire:
    """How one server streams a request: its route, the request's body, and the tokens received so far in a chunk."""

    path: str
    payload: Callable[[BenchRequest], dict]
    tokens_so_far: Callable[[dict], int]  # cumulative count, from one streamed chunk
    keep_alive: bool = True  # reuse connections (a server that closes idle ones after seconds wants a new one each)


def generate_payload(request: BenchRequest) -> dict:
    return {
        "input_ids": request.input_ids,
        "sampling_params": {"max_new_tokens": request.output_len, "temperature": 0.0, "ignore_eos": True},
        "lora_path": request.adapter,
        "stream": True,
    }


LORAPLEX = Wire("/generate", generate_payload, lambda chunk: len(chunk["output_ids"]))  # chunks are cumulative


async def stream_generate(session: aiohttp.ClientSession, url: str, request: BenchRequest, run_start: float,
                          result: RequestResult | None = None, wire: Wire = LORAPLEX) -> RequestResult:
    """One streamed request (loraplex's /generate unless another wire is given); every token's arrival time
    recorded. Errors are recorded, never raised.

    Fills `result` as tokens arrive when one is given, so a cancelled request leaves what it got.
    """
    if result is None:
        result = RequestResult(request.index, request.adapter, len(request.input_ids), request.output_len)
    sent = time.perf_counter()
    result.start_s = sent - run_start
    last, num_tokens = sent, 0
    try:
        async with session.post(url + wire.path, json=wire.payload(request)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            async for line in resp.content:
                if not line.startswith(SSE_PREFIX):
                    continue
                data = line[len(SSE_PREFIX):].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error']}"
                    break
                now = time.perf_counter()
                new_tokens = wire.tokens_so_far(chunk) - num_tokens
                if new_tokens <= 0:
                    continue
                if num_tokens == 0:
                    result.ttft_s = now - sent
                else:
                    result.itl_s.extend([(now - last) / new_tokens] * new_tokens)
                    result.itl_times_s.extend([now - run_start] * new_tokens)
                num_tokens += new_tokens
                result.num_output_tokens = num_tokens
                last = now
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
    result.num_output_tokens = num_tokens
    result.latency_s = last - sent
    if result.error is None and num_tokens != request.output_len:
        result.error = f"got {num_tokens} tokens, asked for {request.output_len}"
    return result


def client_session(concurrency: int | None, keep_alive: bool = True) -> aiohttp.ClientSession:
    # No total timeout: a long benchmark request is not a failure. No connection cap beyond the concurrency.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    connector = aiohttp.TCPConnector(limit=concurrency or 0, force_close=not keep_alive)
    return aiohttp.ClientSession(timeout=timeout, connector=connector)


async def run_requests(url: str, requests: list[BenchRequest], *, concurrency: int | None = None,
                       progress: bool = True, desc: str = "requests",
                       wire: Wire = LORAPLEX) -> tuple[list[RequestResult], float]:
    """Sends each request at its arrival time, at most `concurrency` in flight; (results, wall seconds)."""
    from tqdm import tqdm

    url = url.rstrip("/")
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    bar = tqdm(total=len(requests), desc=desc, disable=not progress, file=sys.stderr)
    async with client_session(concurrency, wire.keep_alive) as session:
        run_start = time.perf_counter()

        async def one(request: BenchRequest) -> RequestResult:
            delay = run_start + request.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                result = await stream_generate(session, url, request, run_start, wire=wire)
            else:
                async with limit:
                    result = await stream_generate(session, url, request, run_start, wire=wire)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(r) for r in requests))
        duration_s = time.perf_counter() - run_start
    bar.close()
    return list(results), duration_s


async def steady_stream(url: str, adapters: list[str | None], concurrency: int, input_len: int, output_len: int,
                        seed: int, run_start: float, stop: asyncio.Event) -> list[RequestResult]:
    """Closed loop: `concurrency` workers, each sending the next request as soon as its last one ends, until stop.

    Output lengths are uniform in [output_len / 2, 3 * output_len / 2]: with one fixed length the requests would end
    and prefill in lockstep, and a whole-batch prefill stall landing in one window and not the other swings its p99.
    """
    spec = WorkloadSpec(num_requests=4096, input_len_range=(input_len, input_len),
                        output_len_range=(max(1, output_len // 2), output_len * 3 // 2), adapter_names=(), seed=seed)
    prompts = make_workload(spec)
    results: list[RequestResult] = []
    counter = iter(range(10**9))

    async def worker(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            i = next(counter)
            request = prompts[i % len(prompts)]
            request = replace(request, index=i, adapter=adapters[i % len(adapters)], arrival_s=0.0)
            result = RequestResult(i, request.adapter, input_len, request.output_len)
            results.append(result)  # before the await: a request cut off at stop keeps its tokens so far
            await stream_generate(session, url, request, run_start, result)

    async with client_session(concurrency) as session:
        tasks = [asyncio.create_task(worker(session)) for _ in range(concurrency)]
        await stop.wait()
        for task in tasks:  # requests still streaming are cut off; their tokens so far are kept
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return results


def gaps_between(results: list[RequestResult], start_s: float, end_s: float) -> list[float]:
    """ITL samples of the tokens that arrived in [start_s, end_s)."""
    return [gap for r in results for gap, t in zip(r.itl_s, r.itl_times_s, strict=True) if start_s <= t < end_s]


async def get_json(url: str, path: str) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(url.rstrip("/") + path) as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {resp.status}: {(await resp.text())[:300]}")
            return await resp.json()


async def sample_server_info(url: str, stop: asyncio.Event, interval_s: float = 0.1) -> list[dict]:
    """/server_info every `interval_s` until stop, each sample with its time ("t_s", from the first)."""
    samples: list[dict] = []
    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        while not stop.is_set():
            async with session.get(url.rstrip("/") + "/server_info") as resp:
                samples.append({**await resp.json(), "t_s": time.perf_counter() - start})
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass
    return samples


async def check_server(url: str, adapters: set[str]) -> None:
    url = url.rstrip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(url + "/health") as resp:
            if resp.status != 200:
                raise SystemExit(f"{url}/health answered {resp.status}")
        if adapters:
            async with session.get(url + "/lora_adapters") as resp:
                loaded = {a["lora_name"] for a in (await resp.json())["adapters"]}
            missing = sorted(adapters - loaded)
            if missing:
                raise SystemExit(f"adapters not loaded on {url}: {', '.join(missing[:8])}"
                                 f"{' ...' if len(missing) > 8 else ''}")


def run_workloads(url: str, wire: Wire, runs: dict[str, tuple[list[BenchRequest], int]]) -> dict[str, dict]:
    """Each workload (requests, most in flight) in turn against one server: {workload: summary}; a failed request
    stops the benchmark (a side-by-side figure with failures in it would mislead)."""
    summaries = {}
    for name, (reqs, concurrency) in runs.items():
        results, duration_s = asyncio.run(run_requests(url, reqs, concurrency=concurrency, desc=name, wire=wire))
        failed = [r for r in results if not r.ok]
        if failed:
            raise SystemExit(f"{name}: {len(failed)} of {len(results)} requests failed; first: {failed[0].error}")
        summaries[name] = summarize(results, duration_s)
    return summaries


async def warm_up(url: str, requests: list[BenchRequest], concurrency: int | None, wire: Wire = LORAPLEX) -> None:
    """One short request (4 tokens) per distinct adapter, base included, so first-use costs (an adapter's first
    trip into a device slot, lazy allocations) stay out of the measurement; the adapter-ops benchmark measures them.
    Each prompt is reversed: the same length, but no prefix the prefix cache could serve to a measured request."""
    first_of: dict[str | None, BenchRequest] = {}
    for r in requests:
        first_of.setdefault(r.adapter, r)
    short = [BenchRequest(r.index, r.input_ids[::-1], min(4, r.output_len), r.adapter, 0.0)
             for r in first_of.values()]
    results, _ = await run_requests(url, short, concurrency=concurrency, progress=False, wire=wire)
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise SystemExit(f"warm-up request failed: {failed[0]}")


async def benchmark(url: str, requests: list[BenchRequest], *, concurrency: int | None, warmup: bool = True,
                    progress: bool = True, desc: str = "bench_serving") -> dict:
    """Checks the server, warms it up, runs the workload: {'summary', 'per_adapter'}."""
    await check_server(url, {r.adapter for r in requests if r.adapter is not None})
    if warmup:
        await warm_up(url, requests, concurrency)
    results, duration_s = await run_requests(url, requests, concurrency=concurrency, progress=progress, desc=desc)
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"{len(failed)} of {len(results)} requests failed; first: {failed[0].error}", file=sys.stderr)
    return {"summary": summarize(results, duration_s), "per_adapter": summarize_per_adapter(results, duration_s)}


def print_report(result: dict) -> None:
    rows = summary_rows("all", result["summary"])
    if len(result["per_adapter"]) > 1:
        for name, summary in result["per_adapter"].items():
            rows += summary_rows(name, summary)
    print(format_table(SUMMARY_HEADERS, rows))
    summary = result["summary"]
    print(f"duration {summary['duration_s']:.1f} s, input {summary['input_token_throughput']:.1f} tok/s, "
          f"E2E p50 {summary['e2e_latency_ms']['p50']:.0f} ms")


def run_and_report(url: str, requests: list[BenchRequest], concurrency: int | None, desc: str,
                   title: str | None = None) -> dict:
    """One run of `requests` (benchmark above), its summary printed under `== title` (default: desc)."""
    result = asyncio.run(benchmark(url, requests, concurrency=concurrency, desc=desc))
    print(f"\n== {title or desc}")
    print_report({"summary": result["summary"], "per_adapter": {}})
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--concurrency", type=int, default=None, help="most requests in flight (closed loop)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the one request per adapter sent first")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    parser.add_argument("--no-progress", action="store_true")
    add_workload_args(parser)
    args = parser.parse_args(argv)
    if args.concurrency is None and math.isinf(args.request_rate):
        parser.error("give --request-rate, --concurrency or both (else every request is sent at once)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    spec = workload_spec_from_args(args)
    requests = make_workload(spec)
    result = asyncio.run(benchmark(args.url, requests, concurrency=args.concurrency,
                                   warmup=not args.no_warmup, progress=not args.no_progress))
    result["config"] = {"url": args.url, "concurrency": args.concurrency, "workload": spec.to_json()}
    print_report(result)
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
