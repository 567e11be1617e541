"""Measure the cluster simulator's step-cost model (cluster.StepCost) on this machine, in process.

Loads the bench model and adapters into a ModelRunner (bench/decode_step.py's make_runner) and times, median of --steps:
decode steps of 1 and --batch base requests (a fixed part and a per-token part), the same batch over 8 adapters (per
adapter), one prefill chunk (per prompt token), copying an adapter into a device slot, and reading one from disk.
Run it on a quiet machine: other processes on the cores distort every figure (torch's threads wait on each other).

    python -m scripts.sim.calibrate --json /tmp/cost.json
    python -m scripts.sim.simulate --cost-json /tmp/cost.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq, SlotLoad

from scripts.bench.decode_step import GREEDY, decode_reqs, make_runner, step_ms
from scripts.bench.model import SIZES, ensure_bench_model
from scripts.sim.cluster import StepCost

NUM_ADAPTERS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--steps", type=int, default=8, help="timed repeats of each measurement")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--json", help="write the StepCost here")
    return parser.parse_args(argv)


def median_ms(steps: int, run) -> float:
    run()  # warm-up
    return statistics.median(run() for _ in range(steps))


def timed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure(args: argparse.Namespace) -> StepCost:
    bench = ensure_bench_model(SIZES[args.size], NUM_ADAPTERS + 1)
    runner, pages = make_runner(bench, dtype=args.dtype, batch=args.batch, context=args.context,
                                max_loras_per_batch=NUM_ADAPTERS, num_adapters=NUM_ADAPTERS)  # fmt: skip
    ids = iter(range(1000, 10**6))
    one = median_ms(args.steps, lambda: step_ms(runner, decode_reqs(pages[:1], args.context, [-1]), next(ids)))
    full = median_ms(args.steps, lambda: step_ms(runner, decode_reqs(pages, args.context, [-1] * args.batch),
                                                 next(ids)))  # fmt: skip
    mixed_slots = sorted(i % NUM_ADAPTERS for i in range(args.batch))
    mixed = median_ms(args.steps, lambda: step_ms(runner, decode_reqs(pages, args.context, mixed_slots), next(ids)))
    # Two points of a line; a busy machine can tilt it, and no cost is below zero.
    decode_token_ms = max(0.0, (full - one) / (args.batch - 1))
    base_ms = max(0.0, one - decode_token_ms)
    adapter_ms = max(0.0, (mixed - full) / NUM_ADAPTERS)

    # Slot copies: rotate the loaded adapters through the slots, so every load really copies.
    rotation = iter(range(10**6))

    def slot_loads_ms() -> float:
        shift = next(rotation)
        loads = [SlotLoad(slot=s, lora_id=(s + shift) % NUM_ADAPTERS + 1) for s in range(NUM_ADAPTERS)]
        return timed_ms(lambda: runner.lora.apply_slot_loads(loads)) / NUM_ADAPTERS

    slot_load_ms = median_ms(args.steps, slot_loads_ms)
    extra = list(bench.adapter_dirs.values())[NUM_ADAPTERS]
    spec = AdapterToLoad(lora_id=999, lora_name="extra", lora_path=str(extra))
    host_load_ms = median_ms(args.steps, lambda: timed_ms(lambda: runner.lora.read([spec])))

    # Last: a prefill chunk rewrites request 0's pages (the decode steps above read them).
    chunk = min(args.context, len(pages[0]) * runner.page_size - 1)
    prompt = [(7 * i) % 1000 + 1 for i in range(chunk)]

    def prefill_ms() -> float:
        req = ForwardReq(input_ids=prompt, num_cached_tokens=0, page_ids=pages[0], sampling=GREEDY)
        return timed_ms(lambda: runner.forward(ForwardBatch(batch_id=next(ids), reqs=[req])))

    prefill_token_ms = max(0.0, (median_ms(args.steps, prefill_ms) - base_ms) / chunk)
    values_ms = dict(base=base_ms, decode_token=decode_token_ms, prefill_token=prefill_token_ms, adapter=adapter_ms,
                     slot_load=slot_load_ms, host_load=host_load_ms)  # fmt: skip
    return StepCost(**{f"{k}_s": v / 1e3 for k, v in values_ms.items()})


def main(argv: list[str] | None = None) -> StepCost:
    args = parse_args(argv)
    cost = measure(args)
    for name, value in dataclasses.asdict(cost).items():
        print(f"{name.removesuffix('_s')}: {value * 1e3:.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(dataclasses.asdict(cost), indent=1))
    return cost


if __name__ == "__main__":
    main()
