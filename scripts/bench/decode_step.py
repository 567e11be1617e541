"""One worker's decode step, in process: the `cpu` backend (kernels/cpu_ext) against the `torch` one it replaces.

Loads the bench model and its adapters into a ModelRunner (no server), prefills `--batch` requests of `--context`
tokens, then times the same decode step over and over, alternating the two paths step by step so that both see the
same machine (this CPU's speed drifts by tens of percent). Batches: base model only, 8 adapters scattered over the
pool (as after a 32-adapter workload), 32 adapters, and the same 32 as DoRA adapters (each bench adapter with
magnitude vectors added: the same products, then each row rescaled); then, on runners whose pool holds rank 4 x 16,
every row on one adapter against every row on a linear mix of 4 (lora_mix: its ranks stacked, rank 64). Prints min
and median step time per path and their ratios, then the adapter forms' two comparisons: DoRA / plain LoRA at 32
adapters and a mix of 4 / one adapter (median over median, per path; `ratios` in --json), and the time the 32 DoRA
adapters took to load on each runner (`dora_load_s`).

    python -m scripts.bench.decode_step            # bfloat16, the full bench model, 32 requests of 200 tokens
    python -m scripts.bench.decode_step --paths torch --size quick --dtype float32   # where the CPU kernels cannot run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from loraplex.kernels import BackendError, select_backend
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq, SamplingParams, SlotLoad
from loraplex.worker.model_runner import ModelRunner
from safetensors.torch import load_file, save_file

from scripts.bench.model import ADAPTER_RANK, SIZES, BenchModel, build_atomically, ensure_bench_model
from scripts.bench.report import format_table, write_json

PAGE_SIZE = 16
GREEDY = SamplingParams(temperature=0.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--batch", type=int, default=32, help="requests in the decode step")
    parser.add_argument("--context", type=int, default=200, help="tokens each request has in the KV cache")
    parser.add_argument("--num-adapters", type=int, default=32, help="adapters loaded (the pool's slots)")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per path and batch")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--paths", default="torch,cpu", help="the LoRA backends compared, comma-separated")
    parser.add_argument("--mix-size", type=int, default=4, help="adapters in the mix row (0: no mix rows)")
    parser.add_argument("--cache-dir", default=None, help="where the bench model is built (default: the bench cache)")
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


def make_runner(
    bench: BenchModel,
    *,
    dtype: str,
    batch: int,
    context: int,
    max_loras_per_batch: int,
    num_adapters: int,
    rank: int = 0,
    tp: int = 1,
    lora_backend: str = "auto",
    max_lora_rank: int = ADAPTER_RANK,
) -> tuple[ModelRunner, list[list[int]]]:
    """A ModelRunner with the first `num_adapters` adapters in slots 0.., and `batch` requests of `context` random
    tokens prefilled (in chunks of 8): the runner and each request's pages. With tp > 1, this process is rank `rank`
    of a TP group it has joined (every rank makes the same calls)."""
    pages_per_req = -(-(context + 1) // PAGE_SIZE)
    config = ServerConfig(
        device="cpu", dtype=dtype, page_size=PAGE_SIZE, max_total_tokens=batch * pages_per_req * PAGE_SIZE,
        enable_lora=True, max_lora_rank=max_lora_rank, lora_target_modules=["all"],
        max_loras_per_batch=max_loras_per_batch, max_running_requests=batch, tp=tp, lora_backend=lora_backend,
    )  # fmt: skip
    runner = ModelRunner(config, str(bench.base_dir), rank=rank, world_size=tp, device="cpu")
    specs = [
        AdapterToLoad(lora_name=name, lora_path=str(path), lora_id=i + 1)
        for i, (name, path) in enumerate(list(bench.adapter_dirs.items())[:num_adapters])
    ]
    assert all(result.success for result in runner.lora.load(specs))
    loads = [SlotLoad(slot=i, lora_id=i + 1) for i in range(len(specs))]

    rng = random.Random(0)
    pages = [list(range(i * pages_per_req, (i + 1) * pages_per_req)) for i in range(batch)]
    for start in range(0, batch, 8):  # prefill in chunks of 8 requests
        reqs = [ForwardReq(input_ids=[rng.randrange(1000) for _ in range(context)], num_cached_tokens=0,
                           page_ids=pages[i], sampling=GREEDY)
                for i in range(start, min(start + 8, batch))]  # fmt: skip
        runner.forward(ForwardBatch(batch_id=start, reqs=reqs, slot_loads=loads if start == 0 else []))
    return runner, pages


def write_dora_copy(path: Path, out: Path) -> None:
    """The PEFT adapter at `path` as a DoRA adapter in `out`: every module's magnitude vector all ones."""
    tensors = load_file(path / "adapter_model.safetensors")
    for key in [k for k in tensors if k.endswith(".lora_B.weight")]:
        magnitude_key = key.removesuffix(".lora_B.weight") + ".lora_magnitude_vector"
        tensors[magnitude_key] = torch.ones(tensors[key].shape[0], dtype=tensors[key].dtype)
    config = json.loads((path / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    save_file(tensors, out / "adapter_model.safetensors")


def dora_copies(runner: ModelRunner, bench: BenchModel, num_adapters: int, first_id: int) -> list[SlotLoad]:
    """Load a DoRA copy of each of the first `num_adapters` bench adapters (magnitudes of ones, written once beside
    them) under ids first_id..; the slot loads that put them in slots 0.. instead of the plain ones."""
    specs = []
    for i, (name, path) in enumerate(list(bench.adapter_dirs.items())[:num_adapters]):
        dora_dir = path.parent / f"{name}-dora"
        build_atomically(dora_dir, lambda out, path=path: write_dora_copy(path, out))
        specs.append(AdapterToLoad(lora_name=f"{name}-dora", lora_path=str(dora_dir), lora_id=first_id + i))
    results = runner.lora.load(specs)
    assert all(result.success for result in results), [r.error_message for r in results if not r.success]
    return [SlotLoad(slot=i, lora_id=spec.lora_id) for i, spec in enumerate(specs)]


def decode_reqs(pages: list[list[int]], context: int, row_slots: list[int]) -> list[ForwardReq]:
    """One decode token per request, request i in slot row_slots[i] (-1 = base)."""
    return [ForwardReq(input_ids=[5], num_cached_tokens=context, page_ids=pages[i], sampling=GREEDY,
                       num_generated=1, slot=slot)
            for i, slot in enumerate(row_slots)]  # fmt: skip


def spread_slots(slots: list[int], batch: int) -> list[int]:
    """`batch` requests' slots taking `slots` in turn, sorted by slot as the scheduler orders a batch."""
    return sorted(slots[i % len(slots)] for i in range(batch))


def load_mix(runner: ModelRunner, adapter_dirs: list[str], slot: int, lora_id: int) -> SlotLoad:
    """A linear mix of these adapters (equal weights) loaded as the frontend loads one, from its tensors; the slot
    load that puts it in `slot`."""
    from loraplex.frontend.adapters.files import encode_tensors, read_adapter_tensors
    from loraplex.frontend.adapters.mix_merge import merge
    from loraplex.protocol.adapters.adapter_config import parse_adapter_config
    from loraplex.protocol.structs import InlineAdapter

    parts = []
    for path in adapter_dirs:
        config, tensors = read_adapter_tensors(path, None)
        parts.append((parse_adapter_config(config), tensors))
    config, tensors = merge(parts, [1.0 / len(parts)] * len(parts), "linear", 1.0, 0)
    specs, buffers = encode_tensors(tensors)
    inline = InlineAdapter(config=config, tensors=specs)
    spec = AdapterToLoad(lora_name="mix", lora_path=None, lora_id=lora_id, inline=inline)
    assert all(result.success for result in runner.lora.load([spec], buffers))
    return SlotLoad(slot=slot, lora_id=lora_id)


def step_ms(runner: ModelRunner, reqs: list[ForwardReq], batch_id: int) -> float:
    """One forward of the decode batch (the same step every time: it rewrites the same KV slot), in ms."""
    start = time.perf_counter()
    runner.forward(ForwardBatch(batch_id=batch_id, reqs=reqs))
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    backends = {"torch": "torch ops", "cpu": "CPU kernels"}
    paths = {backends[b]: b for b in args.paths.split(",")}
    if "cpu" in paths.values():
        try:  # the LoRA backend decides the model's kernels too; each layer binds its ops when built: one runner each
            select_backend("cpu", "cpu", getattr(torch, args.dtype))
        except BackendError as e:
            sys.exit(str(e))
    bench = ensure_bench_model(SIZES[args.size], max(args.num_adapters, args.mix_size), args.cache_dir)
    specs = list(bench.adapter_dirs)[: args.num_adapters]

    def runners_with(max_lora_rank: int, num_adapters: int) -> tuple[dict[str, ModelRunner], list[list[int]]]:
        runners = {}
        for path, lora_backend in paths.items():
            runners[path], pages = make_runner(
                bench, dtype=args.dtype, batch=args.batch, context=args.context,
                max_loras_per_batch=max(num_adapters, 2), num_adapters=num_adapters, lora_backend=lora_backend,
                max_lora_rank=max_lora_rank,
            )  # fmt: skip
        return runners, pages

    few = sorted(random.Random(3).sample(range(len(specs)), min(8, len(specs))))
    runners, pages = runners_with(ADAPTER_RANK, args.num_adapters)
    results, rows = {}, []
    batches = {
        "base only": [-1],
        f"{len(few)} adapters (scattered slots)": few,
        f"{len(specs)} adapters": list(range(len(specs))),
    }
    time_batches(args, runners, pages, batches, results, rows)
    start = time.perf_counter()
    for runner in runners.values():  # the same adapters as DoRA adapters, in the same slots
        runner.lora.apply_slot_loads(dora_copies(runner, bench, len(specs), first_id=2000))
    dora_load_s = (time.perf_counter() - start) / len(runners)  # each adapter read and its norms computed
    dora_row = f"{len(specs)} DoRA adapters"
    time_batches(args, runners, pages, {dora_row: list(range(len(specs)))}, results, rows)
    ratios = {f"DoRA / plain LoRA, {len(specs)} adapters": (dora_row, f"{len(specs)} adapters")}
    if args.mix_size:
        # one adapter in slot 0, the mix of the first mix_size adapters in slot 1, on a pool that holds its rank
        runners, pages = runners_with(ADAPTER_RANK * args.mix_size, 1)
        mix_dirs = [str(path) for path in list(bench.adapter_dirs.values())[: args.mix_size]]
        for runner in runners.values():
            load = load_mix(runner, mix_dirs, slot=1, lora_id=1000)
            runner.forward(ForwardBatch(batch_id=99, reqs=decode_reqs(pages, args.context, [1]), slot_loads=[load]))
        one_row, mix_row = (f"1 adapter, every row (rank-{ADAPTER_RANK * args.mix_size} pool)",
                            f"a mix of {args.mix_size}, every row")
        time_batches(args, runners, pages, {one_row: [0], mix_row: [1]}, results, rows)
        ratios[f"a mix of {args.mix_size} / one adapter"] = (mix_row, one_row)
    base = rows[0][1:]
    both = len(paths) == 2
    for row in rows:
        if both:
            row.append(row[2] / row[4])  # the speedup of the second path's median over the first's
        row.extend(base[2 * i + 1] / row[2 * i + 2] for i in range(len(paths)))
    headers = ["decode step, ms"]
    for path in paths:
        headers += [f"{path} min", "median"]
    headers += ["speedup"] * both + [f"base/this ({path})" for path in paths]
    print(f"{args.batch} requests x {args.context} tokens of context, {args.dtype}, {torch.get_num_threads()} threads")
    print(format_table(headers, rows))
    # the two comparisons the adapter forms ask for: median step time of one row over another's, per path
    medians = {name: {path: results[a][path]["median_ms"] / results[b][path]["median_ms"] for path in paths}
               for name, (a, b) in ratios.items()}  # fmt: skip
    for name, by_path in medians.items():
        print(f"{name} (median): " + ", ".join(f"{path} {ratio:.2f}" for path, ratio in by_path.items()))
    print(f"DoRA set-up: {len(specs)} adapters loaded (their norms included) in {dora_load_s:.1f} s per runner")
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results, "ratios": medians, "dora_load_s": dora_load_s})
    return {**results, "ratios": medians, "dora_load_s": dora_load_s}


def time_batches(
    args: argparse.Namespace,
    runners: dict[str, ModelRunner],
    pages: list[list[int]],
    batches: dict[str, list[int]],
    results: dict,
    rows: list,
) -> None:
    """Each batch's decode step on every runner, the paths alternating step by step: min and median per path."""
    for name, slots in batches.items():
        reqs = decode_reqs(pages, args.context, spread_slots(slots, args.batch))
        times: dict[str, list[float]] = {path: [] for path in runners}
        for step in range(args.steps + 2):
            for path, runner in runners.items():
                elapsed_ms = step_ms(runner, reqs, 100 + step)
                if step >= 2:  # the first steps warm caches and plans
                    times[path].append(elapsed_ms)
        results[name] = {path: {"min_ms": min(t), "median_ms": statistics.median(t)} for path, t in times.items()}
        rows.append([name, *(v for t in times.values() for v in (min(t), statistics.median(t)))])


if __name__ == "__main__":
    main()
