"""What sampling options cost one worker's decode step, in process: plain greedy rows against rows that ask for
penalties, min-p or logprobs, on a share of the batch.

Loads the bench model and its adapters into a ModelRunner (no server), prefills `--batch` requests of `--context`
tokens over 8 adapters, then times the same decode step for each variant, alternating the variants step by step so
that all see the same machine (this CPU's speed drifts by tens of percent). Prints min and median step time per
variant and its ratio to plain greedy.

    python -m scripts.bench.sampling_options             # bfloat16, the full bench model, 32 requests of 200 tokens
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import msgspec
import torch
from loraplex.protocol.structs import ForwardBatch, ForwardReq, SamplingParams
from loraplex.worker.model_runner import ModelRunner

from scripts.bench.decode_step import decode_reqs, make_runner
from scripts.bench.model import SIZES, ensure_bench_model
from scripts.bench.report import format_table, write_json

PENALTIES = SamplingParams(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
VARIANTS = {  # name -> (sampling of the rows that ask, share of the batch that asks)
    "plain greedy": (None, 0.0),
    "penalties, 25% of rows": (PENALTIES, 0.25),
    "penalties, all rows": (PENALTIES, 1.0),
    "temperature 0.8 (seeded), all rows": (SamplingParams(temperature=0.8, seed=1), 1.0),
    "the same + min_p 0.1, all rows": (SamplingParams(temperature=0.8, min_p=0.1, seed=1), 1.0),
    "top-5 logprobs, all rows": (SamplingParams(temperature=0.0, logprobs=5), 1.0),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--batch", type=int, default=32, help="requests in the decode step")
    parser.add_argument("--context", type=int, default=200, help="tokens each request has so far")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per variant")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


def variant_reqs(base: list[ForwardReq], sampling: SamplingParams | None, share: float) -> list[ForwardReq]:
    """The decode batch with its first `share` of rows asking; a row's req_key is its index."""
    num_asking = round(share * len(base))
    return [
        msgspec.structs.replace(req, sampling=sampling, req_key=i) if i < num_asking else req
        for i, req in enumerate(base)
    ]


def seed_histories(runner: ModelRunner, reqs: list[ForwardReq], context: int) -> None:
    """Every row's token history as if it had generated half its context (the step then keeps it at that length)."""
    rng = random.Random(1)
    history = [
        msgspec.structs.replace(req, sampling=PENALTIES, req_key=i, num_generated=context // 2,
                                history_ids=[rng.randrange(runner.vocab_size) for _ in range(context)])
        for i, req in enumerate(reqs)
    ]  # fmt: skip
    with torch.inference_mode():
        runner.histories.update(history, list(range(len(history))))


def step_ms(runner: ModelRunner, reqs: list[ForwardReq], batch_id: int) -> float:
    start = time.perf_counter()
    runner.step(ForwardBatch(batch_id=batch_id, reqs=reqs))  # the same step every time: it rewrites one KV slot
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bench = ensure_bench_model(SIZES[args.size], 8)
    runner, pages = make_runner(bench, dtype=args.dtype, batch=args.batch, context=args.context,
                                max_loras_per_batch=8, num_adapters=8)  # fmt: skip
    base = decode_reqs(pages, args.context, sorted(i % 9 - 1 for i in range(args.batch)))  # base and 8 adapters
    base = [msgspec.structs.replace(req, num_generated=args.context // 2) for req in base]
    seed_histories(runner, base, args.context)
    batches = {name: variant_reqs(base, sampling, share) for name, (sampling, share) in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in batches}
    for step in range(args.steps + 2):
        for name, reqs in batches.items():
            elapsed_ms = step_ms(runner, reqs, 100 + step)
            if step >= 2:  # the first steps warm caches and plans
                times[name].append(elapsed_ms)
    plain = statistics.median(times["plain greedy"])
    rows = [[name, min(t), statistics.median(t), statistics.median(t) / plain] for name, t in times.items()]
    print(f"{args.batch} requests x {args.context} tokens, {args.dtype}, {torch.get_num_threads()} threads, "
          f"vocabulary {runner.vocab_size}")  # fmt: skip
    print(format_table(["decode step", "min ms", "median ms", "median / plain"], rows))
    results = {name: {"min_ms": min(t), "median_ms": statistics.median(t)} for name, t in times.items()}
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results})
    return results


if __name__ == "__main__":
    main()
