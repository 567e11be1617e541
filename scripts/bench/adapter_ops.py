"""Adapter load/unload cost on a running server started with --enable-lora, next to what it cannot beat.

    python -m scripts.bench.adapter_ops --url http://127.0.0.1:30000 --adapter-path DIR --cycles 20 \
        --ops-per-second 2 --duration 60

1. Idle: `--cycles` times, read and parse the adapter's files in this process (json + safetensors load_file; the
   files are in the page cache), then load them through the server (request -> 200), then unload. A load can
   hardly beat the read, so load / read says what the server adds.
2. One steady stream of decode requests (closed loop, `--stream-concurrency` in flight, short prompts so prefill
   barely shows, output lengths spread around `--output-len`) runs through both windows below; ITL counts the tokens
   that arrive inside each window.
   Quiet: `--duration` s with no adapter operations. Storm: the next `--duration` s with `--ops-per-second` adapter
   operations (a load of `--adapter-path` under a fresh name, then its unload, alternating, on a fixed clock). The
   loads of the storm are the "busy" load latencies, set against read + one decode step (the quiet ITL p50).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path

import aiohttp

from scripts.bench.report import distribution_ms, format_table, write_json
from scripts.bench.serving import client_session, gaps_between, steady_stream


def read_adapter_files(adapter_dir: Path) -> float:
    """Seconds to read and parse the adapter as a server must: its config and all its tensors."""
    from safetensors.torch import load_file

    start = time.perf_counter()
    json.loads((adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    elapsed = time.perf_counter() - start
    del tensors
    return elapsed


async def adapter_op(session: aiohttp.ClientSession, url: str, op: str, body: dict) -> float:
    start = time.perf_counter()
    async with session.post(f"{url}/{op}_lora_adapter", json=body) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"{op} {body.get('lora_name')!r}: HTTP {resp.status}: {text[:300]}")
    return time.perf_counter() - start


async def load_unload(session: aiohttp.ClientSession, url: str, name: str, path: Path) -> tuple[float, float]:
    load_s = await adapter_op(session, url, "load", {"lora_name": name, "lora_path": str(path)})
    unload_s = await adapter_op(session, url, "unload", {"lora_name": name})
    return load_s, unload_s


async def idle_cycles(url: str, adapter_dir: Path, cycles: int, prefix: str) -> dict:
    read_adapter_files(adapter_dir)  # into the page cache
    reads, loads, unloads = [], [], []
    async with client_session(None) as session:
        await load_unload(session, url, f"{prefix}warmup", adapter_dir)
        for i in range(cycles):
            reads.append(read_adapter_files(adapter_dir))
            load_s, unload_s = await load_unload(session, url, f"{prefix}idle-{i}", adapter_dir)
            loads.append(load_s)
            unloads.append(unload_s)
    return {"read_ms": distribution_ms(reads), "load_ms": distribution_ms(loads), "unload_ms": distribution_ms(unloads),
            "cycles": cycles}


async def storm(url: str, adapter_dir: Path, ops_per_second: float, duration_s: float, prefix: str) -> dict:
    loads, unloads = [], []
    interval_s = 1.0 / ops_per_second
    async with client_session(None) as session:
        start = time.perf_counter()
        num_ops, pair = 0, 0
        while time.perf_counter() - start < duration_s:
            name = f"{prefix}storm-{pair}"
            if num_ops % 2 == 0:
                loads.append(await adapter_op(session, url, "load", {"lora_name": name, "lora_path": str(adapter_dir)}))
            else:
                unloads.append(await adapter_op(session, url, "unload", {"lora_name": name}))
                pair += 1
            num_ops += 1
            delay = start + num_ops * interval_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        if num_ops % 2 == 1:  # never leave the last storm adapter loaded
            unloads.append(await adapter_op(session, url, "unload", {"lora_name": f"{prefix}storm-{pair}"}))
            num_ops += 1
        elapsed = time.perf_counter() - start
    return {"load_ms": distribution_ms(loads), "unload_ms": distribution_ms(unloads), "num_ops": num_ops,
            "achieved_ops_per_second": num_ops / elapsed}


async def loaded_adapters(url: str) -> list[str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(f"{url}/lora_adapters") as resp:
            return sorted(a["lora_name"] for a in (await resp.json())["adapters"])


async def benchmark(url: str, adapter_dir: Path, *, cycles: int = 20, ops_per_second: float = 2.0,
                    duration_s: float = 60.0, settle_s: float = 3.0, stream_concurrency: int = 8,
                    stream_adapters: list[str] | None = None, input_len: int = 32, output_len: int = 128,
                    seed: int = 0, prefix: str = "bench-ops-") -> dict:
    url = url.rstrip("/")
    adapter_dir = Path(adapter_dir)
    loaded = await loaded_adapters(url)
    async with client_session(None) as session:  # leftovers of an interrupted run would clash with our names
        for name in loaded:
            if name.startswith(prefix):
                await adapter_op(session, url, "unload", {"lora_name": name})
    idle = await idle_cycles(url, adapter_dir, cycles, prefix)
    if stream_adapters is None:  # the adapters already on the server, else the base model
        stream_adapters = [name for name in loaded if not name.startswith(prefix)][:stream_concurrency]
    adapters: list[str | None] = list(stream_adapters) or [None]

    run_start, stop = time.perf_counter(), asyncio.Event()
    stream_task = asyncio.create_task(steady_stream(url, adapters, stream_concurrency, input_len, output_len, seed,
                                                    run_start, stop))
    quiet_start = settle_s
    storm_start = quiet_start + duration_s
    await asyncio.sleep(max(0.0, run_start + storm_start - time.perf_counter()))
    storm_result = await storm(url, adapter_dir, ops_per_second, duration_s, prefix)
    storm_end = time.perf_counter() - run_start
    stop.set()
    results = await stream_task
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} stream requests failed during the adapter benchmark; first: {errors[0]}")

    quiet_itl = distribution_ms(gaps_between(results, quiet_start, storm_start))
    storm_itl = distribution_ms(gaps_between(results, storm_start, storm_end))
    busy = {**storm_result, "itl_ms": storm_itl}
    read_ms = idle["read_ms"]["p50"]
    return {
        "idle": idle,
        "quiet": {"itl_ms": quiet_itl, "window_s": storm_start - quiet_start},
        "storm": busy,
        "stream": {"concurrency": stream_concurrency, "adapters": [a or "<base>" for a in adapters],
                   "input_len": input_len, "output_len": output_len, "num_requests": len(results)},
        "ratios": {
            "idle_load_over_read_p50": idle["load_ms"]["p50"] / read_ms,
            "busy_load_over_read_plus_step_p50": busy["load_ms"]["p50"] / (read_ms + quiet_itl["p50"]),
            "storm_over_quiet_itl_p99": storm_itl["p99"] / quiet_itl["p99"],
        },
    }


def print_report(result: dict) -> None:
    idle, quiet, busy = result["idle"], result["quiet"], result["storm"]
    rows = [
        ["read + parse files (idle)", idle["read_ms"]["p50"], idle["read_ms"]["p99"]],
        ["load (idle)", idle["load_ms"]["p50"], idle["load_ms"]["p99"]],
        ["unload (idle)", idle["unload_ms"]["p50"], idle["unload_ms"]["p99"]],
        ["load (storm, decoding)", busy["load_ms"]["p50"], busy["load_ms"]["p99"]],
        ["unload (storm, decoding)", busy["unload_ms"]["p50"], busy["unload_ms"]["p99"]],
        ["stream ITL (quiet)", quiet["itl_ms"]["p50"], quiet["itl_ms"]["p99"]],
        ["stream ITL (storm)", busy["itl_ms"]["p50"], busy["itl_ms"]["p99"]],
    ]
    print(format_table(("ms", "p50", "p99"), rows))
    ratios = result["ratios"]
    print(f"load/read (idle) {ratios['idle_load_over_read_p50']:.2f}; load/(read + decode step) (busy) "
          f"{ratios['busy_load_over_read_plus_step_p50']:.2f}; ITL p99 storm/quiet "
          f"{ratios['storm_over_quiet_itl_p99']:.2f}; storm ran {busy['achieved_ops_per_second']:.2f} ops/s")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--adapter-path", required=True, help="the PEFT adapter loaded and unloaded")
    parser.add_argument("--cycles", type=int, default=20, help="idle load/unload cycles")
    parser.add_argument("--ops-per-second", type=float, default=2.0, help="storm: loads + unloads per second")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of each of the quiet and storm windows")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds the stream runs before the quiet window")
    parser.add_argument("--stream-concurrency", type=int, default=8)
    parser.add_argument("--stream-adapters", nargs="*", default=None,
                        help="adapters the stream uses, round robin (default: those loaded; none = base)")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128, help="mean output length of the stream's requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name-prefix", default="bench-ops-", help="names of the adapters this script loads")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    if args.ops_per_second <= 0 or args.duration <= 0 or math.isnan(args.ops_per_second):
        parser.error("--ops-per-second and --duration must be > 0")
    result = asyncio.run(benchmark(
        args.url, Path(args.adapter_path), cycles=args.cycles, ops_per_second=args.ops_per_second,
        duration_s=args.duration, settle_s=args.settle, stream_concurrency=args.stream_concurrency,
        stream_adapters=args.stream_adapters, input_len=args.input_len, output_len=args.output_len, seed=args.seed,
        prefix=args.name_prefix))
    print_report(result)
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
