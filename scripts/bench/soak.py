"""Soak: a server with fair sharing, per-key limits and priorities on, under mixed traffic for a while; afterwards
nothing may be lost, no error may have happened beyond the limits' 429s, and the server's memory may not have grown.

    python -m scripts.bench.soak --duration-s 600                       # the demo model, 10 minutes
    python -m scripts.bench.soak --duration-s 180 --audit-log /tmp/audit.jsonl --json out.json

The server: the demo model and its three adapters, `--api-key` and `--admin-api-key`, per-key limits
(`--max-requests-per-minute-per-key`, `--max-tokens-per-minute-per-key`), `--max-running-per-adapter`,
`--scheduling-policy priority`, fair admission (the default); `--audit-log PATH` is handed to the server as it is, and
`--server-args "..."` any other flags. The traffic, all at once for --duration-s:
- --concurrency closed-loop clients, each request a random one of: native /generate (streamed or not), OpenAI
  completions and chat (streamed or not), on the base model or an adapter, with a random priority; about one stream in
  ten is cut by the client after its first chunk (an abort). Outputs have an exact length (ignore_eos), so a complete
  answer is known to be complete. A 429 must carry Retry-After; the client waits it out (at most a second) and sends on.
- an admin loop: load a copy of an adapter under a new name, generate with it, unload it; again and again.
Checks, each a failure of the run (exit 1): any error (a status other than 200 and the expected 429, a short answer,
an error in a stream, a failed adapter operation); requests still in flight or adapter holds left on the server at the
end; the server's resident memory (the frontend and every child process) grown by 2 % or more from the end of the
warm-up (the first --warmup-s) to the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import psutil
from loraplex.frontend.demo import demo_adapter_paths

from scripts.bench.report import format_table, write_json
from tests.server_utils import ServerProcess

KEY, ADMIN_KEY = "soak-key", "soak-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
ADAPTERS = ("reverse", "sort", "mirror")
MAX_RSS_GROWTH = 0.02


@dataclass
class Tally:
    ok: int = 0
    rate_limited: int = 0
    aborted: int = 0  # cut by the client on purpose
    adapter_ops: int = 0
    errors: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        if len(self.errors) < 50:  # the first ones say enough
            self.errors.append(what)
        else:
            self.errors[-1] = f"... and more ({what})"


def server_args(args: argparse.Namespace) -> list[str]:
    flags = ["--model-path", "demo", "--api-key", KEY, "--admin-api-key", ADMIN_KEY,
             "--max-requests-per-minute-per-key", str(args.requests_per_minute),
             "--max-tokens-per-minute-per-key", str(args.tokens_per_minute),
             "--max-running-per-adapter", str(args.max_running_per_adapter), "--scheduling-policy", "priority",
             "--max-running-requests", str(args.max_running_requests), "--max-loaded-loras", "8"]
    if args.audit_log:
        flags += ["--audit-log", args.audit_log]
    return flags + shlex.split(args.server_args)


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    proc = psutil.Process(pid)
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def one_request(rng: random.Random) -> tuple[str, dict, int, bool, bool]:
    """(path, body, output tokens expected, streamed, cut after the first chunk)."""
    model = rng.choice([None, *ADAPTERS])
    num_tokens = rng.randint(4, 24)
    stream = rng.random() < 0.5
    cut = stream and rng.random() < 0.1
    priority = rng.randint(-1, 1)
    prompt = " ".join(rng.choice(["red", "blue", "green", "one", "two", "three"]) for _ in range(rng.randint(2, 12)))
    kind = rng.choice(["generate", "completions", "chat"])
    if kind == "generate":
        body = {"text": prompt, "stream": stream, "lora_path": model, "priority": priority,
                "sampling_params": {"max_new_tokens": num_tokens, "ignore_eos": True, "temperature": 0.7}}
        return "/generate", body, num_tokens, stream, cut
    body = {"model": model or "demo", "stream": stream, "max_tokens": num_tokens, "ignore_eos": True,
            "priority": priority}
    if kind == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}, num_tokens, \
            stream, cut
    return "/v1/completions", {**body, "prompt": prompt}, num_tokens, stream, cut


def tokens_in_answer(path: str, answer: dict) -> int:
    if path == "/generate":
        return len(answer["output_ids"])
    return answer["usage"]["completion_tokens"]


async def read_stream(resp: aiohttp.ClientResponse, path: str, cut: bool) -> tuple[int | None, str | None]:
    """(output tokens streamed, or None when cut on purpose; an error in the stream)."""
    num_tokens = 0
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            return num_tokens, None
        chunk = json.loads(data)
        if "error" in chunk:
            return num_tokens, f"stream error: {chunk['error']}"
        if cut:
            resp.close()  # drops the connection: the server aborts the request
            return None, None
        if path == "/generate":
            num_tokens = len(chunk["output_ids"]) if "output_ids" in chunk else num_tokens
        else:
            num_tokens += sum(1 for c in chunk["choices"] if c.get("text") or (c.get("delta") or {}).get("content"))
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    return num_tokens, "stream ended without [DONE]"


async def client(url: str, session: aiohttp.ClientSession, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        path, body, expected, stream, cut = one_request(rng)
        if stream and path != "/generate":
            body["stream_options"] = {"include_usage": True}  # the exact count, not one text piece per token
        try:
            async with session.post(url + path, json=body, headers=AUTH) as resp:
                if resp.status == 429:
                    retry_after = resp.headers.get("Retry-After")
                    if retry_after is None or not retry_after.isdigit() or int(retry_after) < 1:
                        tally.error(f"429 without a Retry-After of whole seconds: {retry_after!r}")
                    tally.rate_limited += 1
                    await asyncio.sleep(min(int(retry_after or 1), 1.0) * rng.random())
                    continue
                if resp.status != 200:
                    tally.error(f"{path}: HTTP {resp.status}: {(await resp.text())[:200]}")
                    continue
                if stream:
                    got, error = await read_stream(resp, path, cut)
                else:
                    got, error = tokens_in_answer(path, await resp.json()), None
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            tally.error(f"{path}: {type(e).__name__}: {e}")
            continue
        if error:
            tally.error(f"{path}: {error}")
        elif got is None:
            tally.aborted += 1
        elif got != expected:
            tally.error(f"{path}: {got} of {expected} tokens")
        else:
            tally.ok += 1


async def adapter_ops(url: str, session: aiohttp.ClientSession, until: float, tally: Tally) -> None:
    source = str(demo_adapter_paths()["reverse"])
    index = 0
    while time.monotonic() < until:
        name = f"soak-{index}"
        index += 1
        steps = [("/load_lora_adapter", {"lora_name": name, "lora_path": source}, ADMIN_AUTH),
                 ("/generate", {"text": "one two", "lora_path": name,
                                "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}, AUTH),
                 ("/unload_lora_adapter", {"lora_name": name}, ADMIN_AUTH)]
        for path, body, auth in steps:
            try:
                async with session.post(url + path, json=body, headers=auth) as resp:
                    text = await resp.text()
                    if resp.status == 429 and path == "/generate":
                        tally.rate_limited += 1
                    elif resp.status != 200:
                        tally.error(f"{path} {name}: HTTP {resp.status}: {text[:200]}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                tally.error(f"{path} {name}: {type(e).__name__}: {e}")
        tally.adapter_ops += 1
        await asyncio.sleep(1.0)


async def sample_rss(pid: int, until: float, samples: list[tuple[float, int]], start: float) -> None:
    while time.monotonic() < until:
        samples.append((time.monotonic() - start, tree_rss(pid)))
        await asyncio.sleep(2.0)


async def run(url: str, pid: int, args: argparse.Namespace) -> tuple[Tally, list[tuple[float, int]], float]:
    tally, samples = Tally(), []
    timeout = aiohttp.ClientTimeout(total=120)
    start = time.monotonic()
    until = start + args.duration_s
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(
            *(client(url, session, args.seed + i, until, tally) for i in range(args.concurrency)),
            adapter_ops(url, session, until, tally),
            sample_rss(pid, until, samples, start),
        )
    samples.append((time.monotonic() - start, tree_rss(pid)))
    return tally, samples, time.monotonic() - start


def leftovers(server: ServerProcess) -> tuple[int, int]:
    """(requests in flight, adapter holds) once the aborts have landed."""
    deadline = time.monotonic() + 20
    while True:
        info = server.get("/server_info", headers=AUTH).json()
        counts = info["num_requests_in_flight"], info["num_adapter_holds"]
        if counts == (0, 0) or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--warmup-s", type=float, default=None,
                        help="the memory baseline is taken after this (default: a fifth of the run, at least 30 s)")
    parser.add_argument("--concurrency", type=int, default=6, help="closed-loop clients")
    parser.add_argument("--requests-per-minute", type=int, default=240, help="--max-requests-per-minute-per-key")
    parser.add_argument("--tokens-per-minute", type=int, default=20000, help="--max-tokens-per-minute-per-key")
    parser.add_argument("--max-running-per-adapter", type=int, default=3)
    parser.add_argument("--max-running-requests", type=int, default=8)
    parser.add_argument("--audit-log", default=None, metavar="PATH", help="handed to the server as --audit-log")
    parser.add_argument("--server-args", default="", help="more server flags, as one shell-quoted string")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH")
    return parser.parse_args(argv)


def soak(args: argparse.Namespace) -> dict:
    """Start the server, run the traffic, read the leftovers: the result, its `passed` verdict included."""
    warmup_s = args.warmup_s if args.warmup_s is not None else max(30.0, args.duration_s / 5)
    with ServerProcess(*server_args(args), start_timeout_s=600) as server:
        tally, samples, elapsed_s = asyncio.run(run(server.url, server.proc.pid, args))
        in_flight, holds = leftovers(server)
    baseline = next((rss for t, rss in samples if t >= warmup_s), samples[-1][1])
    final = samples[-1][1]
    growth = final / baseline - 1
    passed = not tally.errors and (in_flight, holds) == (0, 0) and growth < MAX_RSS_GROWTH and tally.ok > 0
    return {"duration_s": elapsed_s, "ok": tally.ok, "rate_limited": tally.rate_limited, "aborted": tally.aborted,
            "adapter_cycles": tally.adapter_ops, "errors": tally.errors, "requests_in_flight_after": in_flight,
            "adapter_holds_after": holds, "rss_baseline_mb": baseline / 2**20, "rss_final_mb": final / 2**20,
            "rss_growth": growth, "rss_samples": samples, "args": {**vars(args), "warmup_s": warmup_s},
            "passed": passed}


def report(result: dict) -> str:
    elapsed_s, ok = result["duration_s"], result["ok"]
    rows = [["duration", f"{elapsed_s:.0f} s", ""],
            ["completed requests", ok, f"{ok / elapsed_s:.1f} /s"],
            ["429 (expected)", result["rate_limited"], "every one with Retry-After"],
            ["aborted by the client", result["aborted"], ""],
            ["adapter load/generate/unload cycles", result["adapter_cycles"], ""],
            ["errors", len(result["errors"]), "must be 0"],
            ["left in flight / adapter holds", f"{result['requests_in_flight_after']} / "
             f"{result['adapter_holds_after']}", "must be 0 / 0"],
            ["server RSS after warm-up -> end", f"{result['rss_baseline_mb']:.0f} -> {result['rss_final_mb']:.0f} MB",
             f"{result['rss_growth']:+.2%} (must be < {MAX_RSS_GROWTH:.0%})"]]
    return format_table(("soak", "value", "note"), rows)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = soak(args)
    print(report(result))
    for error in result["errors"][:10]:
        print("error:", error, file=sys.stderr)
    print("PASSED" if result["passed"] else "FAILED")
    if args.json:
        write_json(args.json, result)
    if not result["passed"]:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
