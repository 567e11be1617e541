"""The decode step against this machine's memory bandwidth: a roofline of our own.

A decode step reads every weight once (and each request's KV cache) and does little arithmetic per byte, so its limit
is the bandwidth at which the worker's threads can read memory. This measures that bandwidth (a large array streamed
with torch, summed, best of --bandwidth-repeats, with the threads the server's worker uses), then, per precision of
the bench model's base (bf16 plain, INT8 per channel, INT4 per group: scripts/bench/quantized.py's copies) and batch
size, the decode step in process (scripts/bench/decode_step.py's ModelRunner, base rows, --context tokens cached per
request): its median time, the bytes it reads (resident linear weights and LM head + each request's KV cache) and the
bandwidth that makes, as a share of the measured one.

    python -m scripts.bench.roofline [--json FILE]               # the full bench model, batches 1, 4, 16, 32
    python -m scripts.bench.roofline --size quick --batches 1,4  # a smoke run

Rows (and --json's "rows"): precision, batch, step_ms, bytes_per_step, bandwidth_gbs, roofline_share.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from loraplex.worker.layers.embedding import LMHead
from loraplex.worker.model_runner import ModelRunner

from scripts.bench.decode_step import decode_reqs, make_runner, step_ms
from scripts.bench.model import SIZES, ensure_bench_model
from scripts.bench.quantized import NUM_WARMUP_STEPS, linear_bytes, quantized_copies
from scripts.bench.report import format_table, write_json
from scripts.bench.server import worker_threads

PRECISIONS = {"plain": "bf16", "int8": "int8", "int4": "int4"}  # quantized_copies' label -> the row's precision


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--batches", default="1,4,16,32", help="decode batch sizes, comma-separated")
    parser.add_argument("--context", type=int, default=128, help="tokens each request has in the KV cache")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per precision and batch")
    parser.add_argument("--array-mib", type=int, default=1024, help="the streamed array (well past the caches)")
    parser.add_argument("--bandwidth-repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: the server worker's)")
    parser.add_argument("--cache-dir", default=None, help="where the bench model is built (default: model.py's)")
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


def read_bandwidth_gbs(num_bytes: int, repeats: int) -> float:
    """Bytes per second (in GB/s, 1e9) at which torch's threads read a float32 array of `num_bytes`: best of
    `repeats` sums (a sum reads each element once, one add per 4 bytes: memory-bound)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()  # first touch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best / 1e9


def weight_bytes(runner: ModelRunner) -> int:
    """Weights a decode step reads: the linears as resident (quantized, plain or laid out for a kernel), a tied LM
    head's too (linear_bytes counts only heads of their own)."""
    head = next(m for m in runner.model.modules() if isinstance(m, LMHead))  # under any LoRA wrapper
    if not getattr(head, "tied", False):
        return linear_bytes(runner)
    return linear_bytes(runner) + (head.gemv.nbytes if head.gemv is not None else head.weight.nbytes)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = args.threads or worker_threads(0)
    torch.set_num_threads(threads)
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = read_bandwidth_gbs(args.array_mib * 2**20, args.bandwidth_repeats)
    print(f"read bandwidth {bandwidth:.1f} GB/s ({threads} threads, {args.array_mib} MiB array, best of "
          f"{args.bandwidth_repeats})")
    models = quantized_copies(ensure_bench_model(SIZES[args.size], 0, args.cache_dir))
    rows = []
    for label, model in models.items():
        # one runner per precision, its requests prefilled once; a batch of b decodes the first b of them
        runner, pages = make_runner(model, dtype="bfloat16", batch=max(batches), context=args.context,
                                    max_loras_per_batch=1, num_adapters=0)  # fmt: skip
        weights = weight_bytes(runner)
        for batch in batches:
            reqs = decode_reqs(pages[:batch], args.context, [-1] * batch)
            times = [step_ms(runner, reqs, step) for step in range(NUM_WARMUP_STEPS + args.steps)]
            ms = statistics.median(times[NUM_WARMUP_STEPS:])
            # each request reads its context and the new token's keys and values, every layer
            num_bytes = weights + batch * (args.context + 1) * runner.kv_bytes_per_token
            gbs = num_bytes / (ms / 1e3) / 1e9
            rows.append({"precision": PRECISIONS[label], "batch": batch, "step_ms": ms, "bytes_per_step": num_bytes,
                         "bandwidth_gbs": gbs, "roofline_share": gbs / bandwidth})  # fmt: skip
        del runner
    headers = ["precision", "batch", "step ms", "MiB read", "GB/s", "share of roofline"]
    print(format_table(headers, [[r["precision"], r["batch"], r["step_ms"], r["bytes_per_step"] / 2**20,
                                  r["bandwidth_gbs"], r["roofline_share"]] for r in rows]))  # fmt: skip
    result = {"read_bandwidth_gbs": bandwidth, "threads": threads, "size": args.size, "context": args.context,
              "rows": rows}  # fmt: skip
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
