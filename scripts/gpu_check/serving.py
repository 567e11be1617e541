"""Groups G4 (1B decode performance and dynamic LoRA, in process) and G5 (the server under load) of
scripts/gpu_check/runner.py. G4 writes the model and adapters under --keep-models; G5 reuses them."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

from scripts.gpu_check.lib import (
    Context,
    LlamaShape,
    hbm_bandwidth,
    max_abs,
    median,
    pct,
    sync,
    wall_ms,
    write_adapter,
    write_llama,
)

SHAPE_1B = LlamaShape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192)
SHAPE_DRY = LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_pos=1024)
NUM_R16_GPU, NUM_R16_DRY = 33, 9  # lora-000 ... plus lora-r64


def _shape(ctx: Context) -> LlamaShape:
    return SHAPE_1B if ctx.is_cuda else SHAPE_DRY


def ensure_models(ctx: Context) -> tuple[Path, dict[str, Path], float]:
    """The 1B-shaped model and its adapters under keep_models (built once; G5 reuses G4's); (dir, adapters, build s)."""
    import torch

    root = ctx.keep_models or ctx.out_dir / "models"
    model_dir = root / ("llama1b" if ctx.is_cuda else "llama-dry")
    num_r16 = NUM_R16_GPU if ctx.is_cuda else NUM_R16_DRY
    names = [f"lora-{i:03d}" for i in range(num_r16)]
    adapters = {name: model_dir.parent / f"{model_dir.name}-adapters" / name for name in [*names, "lora-r64"]}
    done = model_dir / ".complete"
    start = time.perf_counter()
    if not done.exists():
        shape = _shape(ctx)
        write_llama(model_dir, shape, ctx.device, torch.bfloat16)
        for i, name in enumerate(names):
            write_adapter(adapters[name], shape, 16, 32, ctx.device, torch.bfloat16, seed=100 + i)
        write_adapter(adapters["lora-r64"], shape, 64, 128, ctx.device, torch.bfloat16, seed=99)
        done.write_text("ok\n")
    return model_dir, adapters, time.perf_counter() - start


def _runner(ctx: Context, model_dir: Path, **overrides):
    from loraplex.protocol.config import ServerConfig
    from loraplex.worker.model_runner import ModelRunner

    kwargs = dict(device=ctx.device.type, dtype="bfloat16", lora_backend=ctx.lora_backend, enable_lora=True,
                  max_lora_rank=64, lora_target_modules=["all"], max_loras_per_batch=40 if ctx.is_cuda else 12,
                  max_running_requests=128, max_total_tokens=131072 if ctx.is_cuda else 16384)
    return ModelRunner(ServerConfig(**{**kwargs, **overrides}), str(model_dir), 0, 1, ctx.device.type)


class Pages:
    """Hands out page ids for fake requests (the scheduler's job in the server)."""

    def __init__(self, num_pages: int):
        self.free = list(range(num_pages))
        random.Random(0).shuffle(self.free)

    def take(self, num_tokens: int, page_size: int) -> list[int]:
        n = -(-num_tokens // page_size)
        taken, self.free = self.free[:n], self.free[n:]
        return taken


def _reqs(prompts, pages, slots, cached=None):
    from loraplex.protocol.structs import ForwardReq, SamplingParams

    greedy = SamplingParams(temperature=0.0)
    cached = cached or [0] * len(prompts)
    return [ForwardReq(input_ids=p, num_cached_tokens=c, page_ids=pg, sampling=greedy, slot=s)
            for p, c, pg, s in zip(prompts, cached, pages, slots, strict=True)]


def g4_decode(ctx: Context) -> None:
    import torch
    from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, SlotLoad
    from loraplex.worker.kv_cache import default_kv_tokens, kv_bytes_per_token

    rec = ctx.rec
    model_dir, adapters, build_s = ensure_models(ctx)
    rec.figure("build_s", build_s)
    shape = _shape(ctx)
    start = time.perf_counter()
    runner = _runner(ctx, model_dir)
    rec.figure("runner_load_s", time.perf_counter() - start)
    kv_tokens = default_kv_tokens(max_running_requests=128, context_length=shape.max_pos,
                                  bytes_per_token=kv_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim,
                                                                     torch.bfloat16), device=ctx.device)
    per_token = kv_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, torch.bfloat16)
    rec.figure("default_kv", {"tokens": kv_tokens, "GiB": kv_tokens * per_token / 2**30})
    num_loaded = 32 if ctx.is_cuda else 8
    names = list(adapters)[:num_loaded]
    ids = {name: i + 1 for i, name in enumerate(names)}
    read_ms = []
    for name in names:
        spec = AdapterToLoad(lora_id=ids[name], lora_name=name, lora_path=str(adapters[name]))
        t0 = time.perf_counter()
        outcomes = runner.lora.read([spec])
        read_ms.append((time.perf_counter() - t0) * 1e3)
        result = runner.lora.install([spec], outcomes)[0]
        if not result.success:
            raise RuntimeError(f"{name}: {result.error_message}")
    rec.figure("read_ms", {"p50": median(read_ms), "max": max(read_ms)})
    rec.check("adapters_loaded", len(runner.lora.adapters) == num_loaded, len(runner.lora.adapters), num_loaded)
    all_loads = [SlotLoad(slot=i, lora_id=ids[n]) for i, n in enumerate(names)]
    runner.forward(ForwardBatch(batch_id=0, reqs=[], slot_loads=all_loads))

    _prefill_perf(ctx, runner, Pages(runner.kv_cache.num_pages), num_loaded, shape)
    _decode_matrix(ctx, runner, Pages(runner.kv_cache.num_pages), shape, adapters)  # KV contents do not matter
    _dynamic_lora(ctx, runner, model_dir, adapters, ids)


def _prefill_perf(ctx: Context, runner, pages: Pages, num_slots: int, shape: LlamaShape) -> None:
    from loraplex.protocol.structs import ForwardBatch

    num_reqs, length, chunk = (128, 512, 16) if ctx.is_cuda else (8, 32, 4)
    rng = random.Random(1)
    page_size = runner.page_size
    total_ms = 0.0
    for first in range(0, num_reqs, chunk):
        prompts = [[rng.randrange(5, 1000) for _ in range(length)] for _ in range(chunk)]
        slots = [(first + i) % num_slots for i in range(chunk)]
        order = sorted(range(chunk), key=lambda i: slots[i])
        reqs = _reqs([prompts[i] for i in order], [pages.take(length, page_size) for _ in order],
                     [slots[i] for i in order])
        total_ms += wall_ms(lambda reqs=reqs: runner.forward(ForwardBatch(batch_id=1, reqs=reqs)), ctx.device)
    long_len = 2048 if ctx.is_cuda else 64
    long_req = _reqs([[rng.randrange(5, 1000) for _ in range(long_len)]], [pages.take(long_len, page_size)], [0])
    batch = ForwardBatch(batch_id=2, reqs=long_req)
    runner.forward(batch)  # warm
    long_ms = median([wall_ms(lambda: runner.forward(batch), ctx.device) for _ in range(ctx.reps(5))])
    tflops = ctx.ceilings.get("bf16_gemm_TFLOPs") or float("nan")
    roofline_ms = 2 * shape.num_params(1000) * long_len / (tflops * 1e12) * 1e3
    ctx.rec.figure("prefill", {"tok_s_128x512": num_reqs * length / total_ms * 1e3, "ms_2048": long_ms,
                               "pct_gemm_roofline": 100 * roofline_ms / long_ms, "tokens": long_len})


def _profile_step(fn) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us()
    total_us = sum(by_name.values())
    lora_us = sum(t for n, t in by_name.items() if "_shrink_kernel" in n or "_expand_kernel" in n)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return {"kernel_ms": total_us / 1e3, "launches": len(kernels), "top10": [[n[:60], t] for n, t in top],
            "lora_share": lora_us / total_us if total_us else None}


def _decode_matrix(ctx: Context, runner, pages: Pages, shape: LlamaShape, adapters: dict[str, Path]) -> None:
    from loraplex.protocol.structs import ForwardBatch

    rec = ctx.rec
    batches, adapter_counts, context = ((1, 32, 128), (0, 8, 32), 512) if ctx.is_cuda else ((1, 4), (0, 2), 32)
    page_size = runner.page_size
    base_bytes = shape.num_params(1000) * 2
    r16_bytes = sum(o + i for o, i in shape.module_shapes().values()) * 16 * 2 * shape.layers
    kv_token_bytes = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2
    copy_gbps = ctx.ceilings.get("copy_GBps") or float("nan")
    hbm_gbps, hbm_source = _hbm(ctx)
    weight_roofline_ms = base_bytes / hbm_gbps / 1e6 if hbm_gbps else float("nan")
    rec.figure("weight_roofline", {"hbm_GBps": hbm_gbps, "source": hbm_source, "weight_bytes": base_bytes,
                                   "ms": weight_roofline_ms})
    table: dict[str, dict] = {}
    for batch_size in batches:
        req_pages = [pages.take(context, page_size) for _ in range(batch_size)]
        table[f"B={batch_size}"] = row = {}
        for num_adapters in adapter_counts:
            slots = sorted(-1 if num_adapters == 0 else i % num_adapters for i in range(batch_size))
            reqs = _reqs([[7]] * batch_size, req_pages, slots, cached=[context - 1] * batch_size)
            batch = ForwardBatch(batch_id=3, reqs=reqs)
            first_ms = wall_ms(lambda batch=batch: runner.forward(batch), ctx.device)
            for _ in range(ctx.warmups()):
                runner.forward(batch)
            walls = [wall_ms(lambda batch=batch: runner.forward(batch), ctx.device) for _ in range(ctx.reps())]
            enqueue = []
            for _ in range(ctx.reps(5)):
                sync(ctx.device)
                t0 = time.perf_counter()
                runner.logits(reqs, [], last_only=True)
                enqueue.append((time.perf_counter() - t0) * 1e3)
            sync(ctx.device)
            wall = median(walls)
            used = min(num_adapters, batch_size)
            roofline_ms = (base_bytes + used * r16_bytes + batch_size * context * kv_token_bytes) / copy_gbps / 1e6
            cell = {"wall_ms_p50": wall, "wall_ms_p90": pct(walls, 90), "tok_s": batch_size / wall * 1e3,
                    "enqueue_ms": median(enqueue), "first_call_ms": first_ms, "x_roofline": wall / roofline_ms,
                    "x_weight_roofline": wall / weight_roofline_ms}
            if ctx.is_cuda:
                profiled = _profile_step(lambda batch=batch: runner.forward(batch))
                cell.update(profiled, busy_pct=100 * profiled["kernel_ms"] / wall,
                            kernels_per_step=profiled["launches"])
            row[f"A={num_adapters}"] = cell
            rec.figure("decode", table)
    if not ctx.is_cuda:
        rec.skip("decode_flags", "dry-run: needs CUDA (profiler, meaningful timings)")
        rec.skip("cuda_graphs",
                 "dry-run: needs CUDA (tests/compute/test_cuda_graphs.py checks the static buffers on a CPU)")
        return
    b1, b32 = table["B=1"], table["B=32"]
    busy = min(c["busy_pct"] for r in table.values() for c in r.values())
    rec.flag("HOST_BOUND", busy < 50, busy, 50, "lowest busy % (kernel time / wall) over the matrix")
    rec.flag("FAR_FROM_ROOFLINE", b1["A=0"]["x_roofline"] > 5, b1["A=0"]["x_roofline"], 5, "B=1 wall / roofline")
    ratio = b32["A=8"]["wall_ms_p50"] / b32["A=0"]["wall_ms_p50"]
    rec.flag("LORA_OVERHEAD", ratio > 1.25, ratio, 1.25, "wall(8 adapters) / wall(base) at B=32")
    stall = max(c["first_call_ms"] - c["wall_ms_p50"] for r in table.values() for c in r.values())
    rec.flag("COMPILE_STALL", stall > 1000, stall, 1000, "worst first call - median, ms")
    _decode_graphs(ctx, runner, batches, adapter_counts, context, table, weight_roofline_ms)


def _hbm(ctx: Context) -> tuple[float | None, str]:
    if not ctx.is_cuda:
        return None, "dry run: no HBM"
    import torch

    return hbm_bandwidth(torch.cuda.get_device_name(ctx.device), ctx.ceilings.get("copy_GBps"))


def _decode_graphs(ctx: Context, runner, batches, adapter_counts, context: int, eager: dict,
                   weight_roofline_ms: float) -> None:
    """The same decode matrix replayed from CUDA graphs (worker/cuda_graphs.py, captured here at the matrix's batch
    sizes), against the eager figures above, with the kernel launches of one replay. Correctness compares like with
    like: the graphs against the same static buffers run eagerly (same padding, same attention split count; the
    eager path picks its split count from the batch, so bf16 logits there differ by rounding: recorded only)."""
    import torch
    from loraplex.protocol.structs import ForwardBatch

    from tests.worker_helpers import forward_logits

    rec = ctx.rec
    if runner.attention.name != "triton":
        rec.skip("cuda_graphs", f"needs the triton attention backend (this runner has {runner.attention.name})")
        return
    start = time.perf_counter()
    graphs = runner.graph_runner(capture=True, batch_sizes=list(batches))
    rec.figure("cuda_graph_capture_s", time.perf_counter() - start)
    static_eager = runner.graph_runner(capture=False, batch_sizes=list(batches))
    pages = Pages(runner.kv_cache.num_pages)  # KV contents do not matter
    table: dict[str, dict] = {}
    worst_same, worst_path, bitwise = 0.0, 0.0, True
    for batch_size in batches:
        req_pages = [pages.take(context, runner.page_size) for _ in range(batch_size)]
        table[f"B={batch_size}"] = row = {}
        for num_adapters in adapter_counts:
            slots = sorted(-1 if num_adapters == 0 else i % num_adapters for i in range(batch_size))
            reqs = _reqs([[7]] * batch_size, req_pages, slots, cached=[context - 1] * batch_size)
            batch = ForwardBatch(batch_id=4, reqs=reqs)
            runner.decode_graphs = None
            path_logits = forward_logits(runner, batch).float()
            runner.decode_graphs = static_eager
            same_logits = forward_logits(runner, batch).float()
            runner.decode_graphs = graphs
            graph_logits = forward_logits(runner, batch).float()
            worst_same = max(worst_same, max_abs(graph_logits, same_logits))
            worst_path = max(worst_path, max_abs(graph_logits, path_logits))
            bitwise &= torch.equal(graph_logits, same_logits)
            for _ in range(ctx.warmups()):
                runner.forward(batch)
            walls = [wall_ms(lambda batch=batch: runner.forward(batch), ctx.device) for _ in range(ctx.reps())]
            wall = median(walls)
            profiled = _profile_step(lambda batch=batch: runner.forward(batch))
            eager_cell = eager[f"B={batch_size}"][f"A={num_adapters}"]
            row[f"A={num_adapters}"] = {
                "wall_ms_p50": wall, "wall_ms_p90": pct(walls, 90), "tok_s": batch_size / wall * 1e3,
                "speedup_vs_eager": eager_cell["wall_ms_p50"] / wall, "launches": profiled["launches"],
                "eager_launches": eager_cell.get("launches"), "kernel_ms": profiled["kernel_ms"],
                "busy_pct": 100 * profiled["kernel_ms"] / wall, "x_weight_roofline": wall / weight_roofline_ms}
            rec.figure("decode_cuda_graph", table)
    runner.decode_graphs = None
    rec.check("cuda_graph.logits_vs_static_eager", worst_same <= 1e-2, worst_same, 1e-2,
              "bf16 logits of a replay vs the same static buffers run eagerly: same kernels, shapes and split count")
    rec.figure("cuda_graph_bitwise_vs_static_eager", bitwise)
    rec.figure("cuda_graph_vs_eager_path_max_abs", worst_path)  # different split counts: rounding only


def _dynamic_run(ctx: Context, runner, prompts, slots, steps: int, churn: dict | None):
    """Prefill then `steps` greedy steps; with churn, adapters load on a thread during forwards and go into unused
    slots between them. (tokens per request, last step's logits, step ms)."""
    from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, SlotLoad

    from tests.worker_helpers import forward_logits

    pages = Pages(runner.kv_cache.num_pages)
    page_size = runner.page_size
    req_pages = [pages.take(len(p) + steps + 1, page_size) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    step_ms, last_logits, previous_extra = [], None, None
    for step in range(steps):
        inputs = prompts if step == 0 else [[out[-1]] for out in outputs]
        cached = [0] * len(prompts) if step == 0 else [len(p) + step - 1 for p in prompts]
        batch = ForwardBatch(batch_id=step, reqs=_reqs(inputs, req_pages, slots, cached))
        thread = None
        if churn is not None and step and step % churn["every"] == 0:
            k = step // churn["every"]
            name = churn["spares"][k % len(churn["spares"])]
            spec = AdapterToLoad(lora_id=churn["next_id"] + k, lora_name=name, lora_path=str(churn["paths"][name]))

            def load(spec=spec):
                t0 = time.perf_counter()
                outcomes = runner.lora.read([spec])
                churn["read_ms"].append((time.perf_counter() - t0) * 1e3)
                runner.lora.install([spec], outcomes)

            thread = threading.Thread(target=load)
            thread.start()
        t0 = time.perf_counter()
        if step == steps - 1:
            last_logits = forward_logits(runner, batch).float().cpu()
            tokens = last_logits.argmax(-1).tolist()
        else:
            tokens = runner.forward(batch)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if thread is not None:
            thread.join()
            runner.lora.apply_slot_loads([SlotLoad(slot=churn["slot0"] + k % churn["num_slots"], lora_id=spec.lora_id)])
            if k % 2 == 0 and previous_extra is not None:
                runner.lora.drop([previous_extra])
            previous_extra = spec.lora_id
        for out, token in zip(outputs, tokens, strict=True):
            out.append(token)
    return outputs, last_logits, step_ms


def _dynamic_lora(ctx: Context, runner, model_dir: Path, adapters: dict[str, Path], ids: dict[str, int]) -> None:
    import torch
    from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, SlotLoad

    from tests.worker_helpers import forward_logits

    rec = ctx.rec
    num_reqs, prompt_len, steps, every = (32, 64, 40, 5) if ctx.is_cuda else (8, 8, 10, 2)
    used_slots = 8 if ctx.is_cuda else 4
    rng = random.Random(2)
    prompts = [[rng.randrange(5, 1000) for _ in range(prompt_len)] for _ in range(num_reqs)]
    slots = sorted(i % used_slots for i in range(num_reqs))
    tokens0, logits0, quiet_ms = _dynamic_run(ctx, runner, prompts, slots, steps, None)
    spares = [n for n in adapters if n not in ids and n != "lora-r64"] or list(ids)[used_slots:]
    churn = {"every": every, "spares": spares, "paths": adapters, "next_id": 1000, "read_ms": [],
             "slot0": 20 if ctx.is_cuda else 8, "num_slots": 8 if ctx.is_cuda else 3}  # slots no request uses
    tokens1, logits1, churn_ms = _dynamic_run(ctx, runner, prompts, slots, steps, churn)
    diff = max_abs(logits0, logits1)
    rec.check("churn_tokens_identical", tokens0 == tokens1, tokens0 == tokens1, True, f"{num_reqs} x {steps} tokens")
    rec.check("churn_logits", diff <= 1e-2, diff, 1e-2, "last step's logits, churn vs quiet")
    dynamic = {"bitwise_unchanged": bool(torch.equal(logits0, logits1)), "read_ms_p50": median(churn["read_ms"]),
               "read_ms_max": max(churn["read_ms"], default=None),
               "step_ms": {"quiet_p50": median(quiet_ms[1:]), "quiet_p99": pct(quiet_ms[1:], 99),
                           "churn_p50": median(churn_ms[1:]), "churn_p99": pct(churn_ms[1:], 99)}}
    dynamic["p99_ratio"] = dynamic["step_ms"]["churn_p99"] / dynamic["step_ms"]["quiet_p99"]
    rec.check("bitwise_unchanged_informational", True, dynamic["bitwise_unchanged"], True,
              "recorded only: a difference means slot writes leak into used slots or a kernel is nondeterministic")
    if ctx.is_cuda:
        rec.flag("CHURN_P99", dynamic["p99_ratio"] > 1.5, dynamic["p99_ratio"], 1.5, "step p99 churn / quiet")

    # a request on lora-r64, loaded mid-run, against a fresh runner that had it from the start
    r64 = AdapterToLoad(lora_id=2000, lora_name="lora-r64", lora_path=str(adapters["lora-r64"]))
    runner.lora.load([r64])
    r64_slot = runner.lora.num_slots - 1
    prompt = prompts[0][:prompt_len]
    pages = Pages(runner.kv_cache.num_pages).take(prompt_len, runner.page_size)
    mid = forward_logits(runner, ForwardBatch(batch_id=0, reqs=_reqs([prompt], [pages], [r64_slot]),
                                           slot_loads=[SlotLoad(slot=r64_slot, lora_id=2000)])).float().cpu()
    fresh = _runner(ctx, model_dir, max_total_tokens=4096, max_loras_per_batch=2)
    fresh.lora.load([r64])
    ref = forward_logits(fresh, ForwardBatch(batch_id=0, reqs=_reqs([prompt], [list(range(len(pages)))], [0]),
                                          slot_loads=[SlotLoad(slot=0, lora_id=2000)])).float().cpu()
    del fresh
    err = max_abs(mid, ref)
    same_argmax = bool(torch.equal(mid.argmax(-1), ref.argmax(-1)))
    rec.check("r64_mid_run_vs_fresh", err <= 0.1 and same_argmax, {"max_abs": err, "same_argmax": same_argmax}, 0.1)

    pool = runner.lora.pool
    for rank_name, name in (("r16", next(iter(ids))), ("r64", None)):
        adapter = runner.lora.adapters[2000 if name is None else ids[name]]
        times = [wall_ms(lambda adapter=adapter: pool.load_slot(r64_slot, adapter), ctx.device)
                 for _ in range(ctx.reps(5))]
        dynamic[f"load_slot_ms_{rank_name}"] = median(times)
    runner.lora.apply_slot_loads([SlotLoad(slot=r64_slot, lora_id=-1)])
    _leak_check(ctx, runner, adapters, r64_slot, dynamic)
    rec.figure("dynamic", dynamic)


def _leak_check(ctx: Context, runner, adapters: dict[str, Path], slot: int, dynamic: dict) -> None:
    import torch
    from loraplex.protocol.structs import AdapterToLoad, SlotLoad

    if not ctx.skip_unless_cuda("gpu_memory_leak"):
        return
    name = next(iter(adapters))
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    host_before = host_stats().get("allocated_bytes.current", 0) if host_stats else None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for k in range(20):
        spec = AdapterToLoad(lora_id=3000 + k, lora_name=name, lora_path=str(adapters[name]))
        runner.lora.load([spec])
        runner.lora.apply_slot_loads([SlotLoad(slot=slot, lora_id=3000 + k)])
        runner.lora.drop([3000 + k])
    torch.cuda.synchronize()
    leak = torch.cuda.memory_allocated() - before
    dynamic["leak_bytes"] = leak
    ctx.rec.check("gpu_memory_leak", leak <= 2**20, leak, 2**20, "memory_allocated delta after 20 load/drop cycles")
    if host_stats:
        growth = host_stats().get("allocated_bytes.current", 0) - host_before
        dynamic["pinned_growth_bytes"] = growth
        ctx.rec.flag("PINNED_GROWTH", growth > 64 * 2**20, growth, 64 * 2**20, "pinned host bytes after 20 cycles")


# ---- G5: server --------------------------------------------------------------------------------------------------

GREEDY_ADAPTER, GREEDY_PROMPT, GREEDY_TOKENS = "lora-007", [11, 22, 33, 44, 55, 66, 77, 88], 16
NEAR_TIE = 0.05  # a greedy divergence where the two best tokens' logprobs (bf16) are this close is rounding, not a bug
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


def _server_args(ctx: Context, model_dir: Path, adapters: dict[str, Path], num_served: int) -> list[str]:
    served = [f"lora-{i:03d}" for i in range(num_served)]
    return ["--device", ctx.device.type, "--dtype", "bfloat16" if ctx.is_cuda else "float32",
            "--model-path", str(model_dir), "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all",
            "--max-loras-per-batch", str(num_served), "--max-running-requests", "64", "--max-total-tokens",
            "131072" if ctx.is_cuda else "16384", "--lora-paths", *[f"{n}={adapters[n]}" for n in served]]


def _load(ctx: Context, server, served: list[str], count: int) -> tuple[dict, list[str]]:
    """One bench_serving run on `count` adapters: its summary and the requests that did not complete exactly."""
    import asyncio

    import scripts.bench.serving as bench_serving
    from scripts.bench.report import summarize
    from scripts.bench.workload import WorkloadSpec, make_workload

    num_requests, in_range, out_range, concurrency = ((128, (64, 256), (32, 128), 64) if ctx.is_cuda
                                                      else (8, (8, 16), (4, 8), 4))
    spec = WorkloadSpec(num_requests=num_requests, input_len_range=in_range, output_len_range=out_range,
                        adapter_names=tuple(served[:count]), seed=0)
    requests = make_workload(spec)

    async def run():
        await bench_serving.warm_up(server.url, requests, concurrency)
        return await bench_serving.run_requests(server.url, requests, concurrency=concurrency, progress=False)

    results, duration_s = asyncio.run(run())
    failed = [r.error or f"{r.num_output_tokens}/{r.output_len} tokens" for r in results if not r.ok]
    return summarize(results, duration_s), failed


def _greedy(server) -> dict:
    """A greedy /generate on GREEDY_ADAPTER: its tokens and, per position, the gap between the two best logprobs."""
    reply = server.post("/generate", {
        "input_ids": GREEDY_PROMPT, "lora_path": GREEDY_ADAPTER, "return_logprob": True, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": GREEDY_TOKENS, "temperature": 0.0, "ignore_eos": True}})
    tops = reply.get("meta_info", {}).get("output_top_logprobs") or []
    gaps = [top[0][0] - top[1][0] if len(top) > 1 else None for top in tops]
    return {"tokens": reply.get("output_ids"), "gaps": gaps}


def tokens_match(ours: list[int], ref: list[int], ref_gaps: list[float | None], near_tie: float) -> tuple[bool, str]:
    """Greedy tokens equal, or equal up to a first divergence where the reference's two best tokens were a near tie
    (after it the sequences legitimately differ)."""
    if ours == ref:
        return True, "equal"
    first = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), len(ref)))
    gap = ref_gaps[first] if first < len(ref_gaps) else None
    if gap is not None and gap <= near_tie:
        return True, f"diverge at {first}, a near tie (gap {gap:.3g} <= {near_tie})"
    return False, f"diverge at {first} (gap {gap})"


def _write_tail(ctx: Context, server, title: str) -> None:
    """The server's log tail into the one server_tail.log under --out (appended: G5 and G5b share it)."""
    tail = "\n".join(server.log().splitlines()[-80:])
    ctx.rec.figure("server_tail", tail)
    with open(ctx.out_dir / "server_tail.log", "a") as f:
        f.write(f"===== {ctx.group} {title}\n{tail}\n")


def g5_server(ctx: Context) -> None:
    """The eager server under load. Each figure is recorded the moment it is measured, so a timeout keeps them."""
    import asyncio

    import scripts.bench.adapter_ops as bench_adapter_ops
    from scripts.gpu_check.server import CheckServer

    rec = ctx.rec
    model_dir, adapters, _ = ensure_models(ctx)
    num_served = 32 if ctx.is_cuda else 8
    served = [f"lora-{i:03d}" for i in range(num_served)]
    start = time.perf_counter()
    server = CheckServer(ctx, *_server_args(ctx, model_dir, adapters, num_served),
                         start_timeout_s=90 if ctx.is_cuda else 100)
    try:
        rec.figure("startup_s", time.perf_counter() - start)
        greedy = _greedy(server)
        rec.figure("greedy", greedy)  # G5b compares its graph server's tokens with these
        _greedy_vs_runner(ctx, greedy["tokens"], model_dir, adapters)
        out_tok_s, failed = {}, {}
        for count in ((0, 8, 32) if ctx.is_cuda else (0, 2, 8)):
            summary, failed[count] = _load(ctx, server, served, count)
            out_tok_s[count] = summary["output_token_throughput"]
            rec.figure("out_tok_s", out_tok_s)
            if count == 0:
                rec.figure("ttft_ms", {"p50": summary["ttft_ms"]["p50"], "p99": summary["ttft_ms"]["p99"]})
                rec.figure("itl_ms", {"p50": summary["itl_ms"]["p50"], "p99": summary["itl_ms"]["p99"]})
            else:
                rec.figure("ratios", {k: v / out_tok_s[0] for k, v in out_tok_s.items() if k})
        bad = {k: v[:2] for k, v in failed.items() if v}
        rec.check("all_requests_exact", not bad, bad or "all complete", "every request, exact length, no error")
        ops = asyncio.run(bench_adapter_ops.benchmark(
            server.url, adapters[f"lora-{num_served:03d}"],  # rank 16, not among the served
            cycles=2 if ctx.is_cuda else 1, ops_per_second=2.0, duration_s=3.0 if ctx.is_cuda else 2.0,
            settle_s=1.0, stream_concurrency=8 if ctx.is_cuda else 2, output_len=128 if ctx.is_cuda else 16))
        storm_quiet = ops["ratios"]["storm_over_quiet_itl_p99"]
        load_over_read = ops["ratios"]["idle_load_over_read_p50"]
        rec.figure("load_ms", {"idle": ops["idle"]["load_ms"]["p50"], "busy": ops["storm"]["load_ms"]["p50"]})
        rec.figure("storm_quiet", storm_quiet)
        if ctx.is_cuda:
            ratios = {k: v / out_tok_s[0] for k, v in out_tok_s.items() if k}
            rec.flag("SERVER_LORA_8", ratios[8] < 0.8, ratios[8], 0.8, "8/0 out tok/s")
            rec.flag("SERVER_LORA_32", ratios[32] < 0.7, ratios[32], 0.7, "32/0 out tok/s")
            rec.flag("STORM_ITL", storm_quiet > 1.5, storm_quiet, 1.5, "ITL p99 storm / quiet")
            rec.flag("LOAD_OVER_READ", load_over_read > 3, load_over_read, 3, "idle load / file read p50")
        else:
            rec.skip("server_flags", "dry-run: CPU timings")
    except BaseException:
        _write_tail(ctx, server, "eager server (failed)")
        raise
    finally:
        server.stop()
    if any(c["kind"] == "check" and c["pass"] is False for c in rec.part["checks"]):
        _write_tail(ctx, server, "eager server (a check failed)")


def _greedy_vs_runner(ctx: Context, server_ids: list[int] | None, model_dir: Path, adapters: dict[str, Path]) -> None:
    """A greedy /generate must give the in-process runner's tokens for the same prompt and adapter (same kernels)."""
    from loraplex.protocol.structs import AdapterToLoad, SamplingParams, SlotLoad

    from tests.worker_helpers import decode

    # the server's pool shape (max rank 16): the kernels' rank block, so the summation order, depends on it
    runner = _runner(ctx, model_dir, max_total_tokens=4096, max_loras_per_batch=2, max_lora_rank=16,
                     dtype="bfloat16" if ctx.is_cuda else "float32")
    runner.lora.load([AdapterToLoad(lora_id=1, lora_name=GREEDY_ADAPTER, lora_path=str(adapters[GREEDY_ADAPTER]))])
    ours = decode(runner, [GREEDY_PROMPT], [SamplingParams(temperature=0.0)], GREEDY_TOKENS, slots=[0],
                  slot_loads=[SlotLoad(slot=0, lora_id=1)])[0]
    del runner
    ctx.rec.check("generate_equals_runner", server_ids == ours, {"server": server_ids, "runner": ours}, "equal",
                  f"greedy {GREEDY_TOKENS} tokens on {GREEDY_ADAPTER}")


# ---- G5b: the server with CUDA graphs, and structured output -------------------------------------------------------


def g5b_server_graphs(ctx: Context) -> None:
    """The same server with --enable-cuda-graph (and the Triton attention the graphs need): its greedy tokens
    against G5's eager server, the ITL ratio graph / eager on the base workload, and one structured-output request
    (xgrammar's mask on CUDA through its Triton path, no nvcc), timed."""
    import json as jsonlib

    from scripts.gpu_check.server import CheckServer

    rec = ctx.rec
    model_dir, adapters, _ = ensure_models(ctx)
    num_served = 32 if ctx.is_cuda else 8
    served = [f"lora-{i:03d}" for i in range(num_served)]
    args = _server_args(ctx, model_dir, adapters, num_served)
    if ctx.is_cuda:  # a dry run has neither: the same server, eager, checks the Python around them
        args += ["--attention-backend", "triton", "--enable-cuda-graph"]
    start = time.perf_counter()
    server = CheckServer(ctx, *args, start_timeout_s=120 if ctx.is_cuda else 100, name="graph_server")
    try:
        rec.figure("startup_s", time.perf_counter() - start)  # includes the capture of every batch size
        eager = _eager_figures(ctx)
        greedy = _greedy(server)
        rec.figure("greedy", greedy)
        if eager.get("greedy"):
            ok, detail = tokens_match(greedy["tokens"], eager["greedy"]["tokens"], eager["greedy"]["gaps"], NEAR_TIE)
            rec.check("graph_tokens_equal_eager", ok, {"graph": greedy["tokens"], "eager": eager["greedy"]["tokens"]},
                      "equal (or a first divergence at a near tie)", detail)
        else:
            rec.skip("graph_tokens_equal_eager", "G5 (the eager server) left no greedy tokens")
        summary, failed = _load(ctx, server, served, 0)
        rec.check("graph_requests_exact", not failed, failed[:2] or "all complete", "every request, exact length")
        itl = {"p50": summary["itl_ms"]["p50"], "p99": summary["itl_ms"]["p99"]}
        rec.figure("itl_ms", itl)
        rec.figure("out_tok_s", summary["output_token_throughput"])
        eager_itl = (eager.get("itl_ms") or {}).get("p50")
        if eager_itl:
            rec.figure("itl_ratio_graph_over_eager", itl["p50"] / eager_itl)
        prompt = GREEDY_PROMPT
        t0 = time.perf_counter()
        try:
            reply = server.post("/generate", {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 48, "temperature": 0.0, "json_schema": jsonlib.dumps(SCHEMA)}})
        except RuntimeError as e:  # refused (a 501 when xgrammar does not import): the check fails with the reason
            rec.check("structured_output", False, str(e)[:400], "valid JSON (prefix)", "the server refused it")
            return
        structured_ms = (time.perf_counter() - t0) * 1e3
        rec.figure("structured_ms", structured_ms)
        finish = (reply.get("meta_info", {}).get("finish_reason") or {})
        finish_type = finish.get("type") if isinstance(finish, dict) else finish
        text = reply.get("text", "")
        valid = _valid_json_prefix(text, finish_type == "stop")
        rec.check("structured_output", valid, {"text": text[:80], "finish": finish_type}, "valid JSON (prefix)",
                  f"{structured_ms:.0f} ms for 48 tokens; the first constrained request compiles the grammar")
        rec.flag("STRUCTURED_STALL", structured_ms > 10_000, structured_ms, 10_000,
                 "a stall this long means a mask kernel was compiled inside the step (nvcc)")
    except BaseException:
        _write_tail(ctx, server, "graph server (failed)")
        raise
    finally:
        server.stop()
    if any(c["kind"] == "check" and c["pass"] is False for c in rec.part["checks"]):
        _write_tail(ctx, server, "graph server (a check failed)")


def _eager_figures(ctx: Context) -> dict:
    """G5's figures, from its part file in the run's scratch directory ({} when G5 did not run)."""
    import json as jsonlib

    part = ctx.scratch / "part_g5.json"
    return jsonlib.loads(part.read_text()).get("figures", {}) if part.exists() else {}


def _valid_json_prefix(text: str, complete: bool) -> bool:
    """A complete response parses; a cut one is a prefix that xgrammar allowed (checked loosely: it starts an
    object)."""
    import json as jsonlib

    if not complete:
        return text.lstrip().startswith("{") or text == ""
    try:
        return isinstance(jsonlib.loads(text), dict)
    except ValueError:
        return False
