"""Row-parallel LoRA under TP=2 (gloo, CPU): the LoRA term summed by the layer's own all-reduce, against an all-reduce
of h of its own per row-parallel LoRA linear (o_proj, down_proj), the formulation the worker used before.

Two spawned ranks load the bench model and its adapters, prefill `--batch` requests of `--context` tokens, then time
the same decode step over and over, alternating the two formulations step by step so that both see the same machine.
Both ranks run the same steps; rank 0's times are reported. Prints per batch the median and min step time and the
all-reduces per step of each.

    python -m scripts.bench.tp_allreduce                  # the quick bench model, fp32, 8 requests, 4 adapters
    python -m scripts.bench.tp_allreduce --size full --batch 32
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import socket
import statistics

import torch
import torch.distributed as dist
from loraplex.protocol.config import ServerConfig
from loraplex.worker.dist import destroy_distributed, init_distributed
from loraplex.worker.lora.layers import LoRALinear
from loraplex.worker.parallel import all_reduce

from scripts.bench.decode_step import decode_reqs, make_runner, spread_slots, step_ms
from scripts.bench.model import SIZES, ensure_bench_model
from scripts.bench.report import format_table, write_json

TP = 2
WARMUP_STEPS = 2
ONE_REDUCE, REDUCE_H = "one all-reduce", "h all-reduced"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="quick")
    parser.add_argument("--batch", type=int, default=8, help="requests in the decode step")
    parser.add_argument("--context", type=int, default=64, help="tokens each request has in the KV cache")
    parser.add_argument("--num-adapters", type=int, default=4, help="adapters loaded and used by the batch")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per formulation and batch")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


def reduce_h_forward(self: LoRALinear, x: torch.Tensor) -> torch.Tensor:
    """The previous LoRALinear.forward, kept here for the comparison: the base layer reduces its output itself, and a
    row-parallel layer's h (tokens, slices * max_rank) gets an all-reduce of its own before the expand."""
    y = self.base(x)
    batch = self.batch
    if self.fused_name not in batch.active:
        return y
    if self.tp_mode == "row" and self.tp_size > 1:
        h = batch.backend.shrink(x, self.buffers, batch.meta)
        batch.backend.expand(y, all_reduce(h, self.tp_size), self.buffers, batch.meta)
    else:
        batch.backend.shrink_expand(y, x, self.buffers, batch.meta)
    return y


def rank_main(rank: int, port: int, args: argparse.Namespace, results: mp.Queue) -> None:
    torch.set_num_threads(1)  # the two ranks share the machine's cores
    init_distributed(ServerConfig(device="cpu", tp=TP), f"127.0.0.1:{port}", rank, torch.device("cpu"))
    try:
        results.put((rank, measure(rank, args)))
    finally:
        destroy_distributed()


def measure(rank: int, args: argparse.Namespace) -> dict:
    bench = ensure_bench_model(SIZES[args.size], args.num_adapters)
    runner, pages = make_runner(bench, dtype=args.dtype, batch=args.batch, context=args.context,
                                max_loras_per_batch=args.num_adapters, num_adapters=args.num_adapters,
                                rank=rank, tp=TP)  # fmt: skip
    num_reduces = 0
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*a, **kw):
        nonlocal num_reduces
        num_reduces += 1
        return real_all_reduce(*a, **kw)

    dist.all_reduce = counting_all_reduce
    forwards = {ONE_REDUCE: LoRALinear.forward, REDUCE_H: reduce_h_forward}
    batches = {"base only": [-1], f"{args.num_adapters} adapters": list(range(args.num_adapters))}
    out = {}
    for name, slots in batches.items():
        reqs = decode_reqs(pages, args.context, spread_slots(slots, args.batch))
        times: dict[str, list[float]] = {path: [] for path in forwards}
        reduces: dict[str, int] = {}
        for step in range(WARMUP_STEPS + args.steps):
            for path, forward in forwards.items():
                LoRALinear.forward = forward
                num_reduces = 0
                elapsed_ms = step_ms(runner, reqs, 100 + step)
                reduces[path] = num_reduces
                if step >= WARMUP_STEPS:
                    times[path].append(elapsed_ms)
        out[name] = {path: {"median_ms": statistics.median(t), "min_ms": min(t), "all_reduces": reduces[path]}
                     for path, t in times.items()}  # fmt: skip
    LoRALinear.forward = forwards[ONE_REDUCE]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    random.seed(0)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(rank, port, args, queue)) for rank in range(TP)]
    for p in procs:
        p.start()
    by_rank = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    results = by_rank[0]
    rows = []
    for name, paths in results.items():
        new, old = paths[ONE_REDUCE], paths[REDUCE_H]
        rows.append([name, old["median_ms"], old["min_ms"], old["all_reduces"], new["median_ms"], new["min_ms"],
                     new["all_reduces"], old["median_ms"] / new["median_ms"]])  # fmt: skip
    headers = ["decode step, TP=2 gloo", f"{REDUCE_H} median ms", "min", "all-reduces", f"{ONE_REDUCE} median ms",
               "min", "all-reduces", "speedup"]  # fmt: skip
    print(f"{args.size} bench model, {args.batch} requests x {args.context} tokens of context, {args.dtype}, "
          f"1 thread per rank; rank 0's times")  # fmt: skip
    print(format_table(headers, rows))
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results})
    return results


if __name__ == "__main__":
    main()
