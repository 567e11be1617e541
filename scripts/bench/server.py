"""The bench model's server for a benchmark: the flags every benchmark shares, its threads, its command-line options.

Each benchmark that compares two server configurations (prefix cache on / off, chunked / whole prefill) starts them
one after the other through `start_server`, so the two differ only in the flags it is given.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from scripts.bench.model import ADAPTER_RANK, DEFAULT_CACHE_DIR
from tests.server_utils import ServerProcess

NUM_CORES = len(os.sched_getaffinity(0))


def server_args(base_dir: Path, adapter_dirs: dict[str, Path], *, dtype: str, max_running_requests: int,
                max_loras_per_batch: int, extra: Sequence[str] = ()) -> list[str]:
    return ["--model-path", str(base_dir), "--dtype", dtype, "--enable-lora", "--max-lora-rank", str(ADAPTER_RANK),
            "--lora-target-modules", "all", "--max-running-requests", str(max_running_requests),
            "--max-loras-per-batch", str(max_loras_per_batch),
            "--lora-paths", *(f"{name}={path}" for name, path in adapter_dirs.items()), *extra]


def server_env(server_threads: int) -> dict[str, str] | None:
    return {"OMP_NUM_THREADS": str(server_threads)} if server_threads else None


def worker_threads(server_threads: int) -> int:
    """The torch threads the server's (single) worker runs: OMP_NUM_THREADS, else its own default of cores - 1."""
    return server_threads or max(1, NUM_CORES - 1)


def start_server(base_dir: Path, adapter_dirs: dict[str, Path], *, dtype: str, server_threads: int,
                 max_running_requests: int, max_loras_per_batch: int, extra: Sequence[str] = ()) -> ServerProcess:
    return ServerProcess(*server_args(base_dir, adapter_dirs, dtype=dtype, max_running_requests=max_running_requests,
                                      max_loras_per_batch=max_loras_per_batch, extra=extra),
                         env=server_env(server_threads), start_timeout_s=600)


def each_server(base_dir: Path, adapter_dirs: dict[str, Path], sides: dict[str, Sequence[str]], *, dtype: str,
                server_threads: int, max_running_requests: int) -> Iterator[tuple[str, ServerProcess]]:
    """A server per side, one after the other, differing only in the side's extra flags; each stops before the next
    starts (when the loop moves on, or leaves)."""
    for side, extra in sides.items():
        with start_server(base_dir, adapter_dirs, dtype=dtype, server_threads=server_threads,
                          max_running_requests=max_running_requests, max_loras_per_batch=len(adapter_dirs),
                          extra=extra) as server:
            yield side, server


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark that starts its own servers takes (all.py and the ratio benchmarks, ratios.py)."""
    parser.add_argument("--quick", action="store_true", help="small model, short workload (a smoke run)")
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE_DIR), help="where the bench model is built")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each workload this many times and keep the best (noisy machines)")
    parser.add_argument("--server-threads", type=int, default=NUM_CORES,
                        help="OMP_NUM_THREADS for the server (default: one per core, as torch gives the PEFT "
                        "baseline; 0 = unset, the worker's own default of cores - 1)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16",
                        help="of the weights and compute (default bfloat16: what a server on a CPU with "
                        "AVX512-BF16/AMX runs, several times faster than float32 there)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write every result here")

