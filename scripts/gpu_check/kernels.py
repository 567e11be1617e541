"""Groups G1 (Triton LoRA kernels against an fp64 reference, then Gated DeltaNet's: gated_delta.py), kernels_small
(the sanitizer's run) and G6 (LoRA op micro-benchmarks) of the GPU check (runner.py). On a CPU dry run the kernels
run in Triton's interpreter at tiny shapes, and bf16 becomes fp16 (the interpreter's bf16 dot is wrong)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from scripts.gpu_check.gated_delta import check_gated_delta
from scripts.gpu_check.lib import Context, max_rel_err, median, time_ms, wall_ms

RANK_CYCLE = (4, 8, 16, 32, 64)
TOLERANCE = {"bfloat16": 8e-3, "float16": 2e-3, "float32": 1e-5}


@dataclass(frozen=True)
class KernelCase:
    name: str
    in_dim: int
    slice_outs: tuple[int, ...]
    max_rank: int
    seg_lens: tuple[int, ...]
    seg_slots: tuple[int, ...]
    dtypes: tuple[str, ...] = ("bfloat16",)
    ranks: tuple[int, ...] | None = None  # per slot; None = RANK_CYCLE capped at max_rank, slot 1 rank 0
    y_pad: int = 0  # y is a [:, y_pad:] view of a wider tensor


def _decode_layout(num_slots: int, rows: int, base_rows: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (base_rows, *[rows] * num_slots), (-1, *range(num_slots))


K1_LENS, K1_SLOTS = _decode_layout(32, 4, 4)
GPU_CASES = [
    KernelCase("K1_decode_1b_qkv", 2048, (2048, 512, 512), 64, K1_LENS, K1_SLOTS, ("bfloat16", "float16", "float32")),
    KernelCase("K2_decode_1b_down", 8192, (2048,), 64, K1_LENS, K1_SLOTS),
    KernelCase("K3_gate_up_1b", 2048, (8192, 8192), 16, (4,) * 8, tuple(range(8))),
    KernelCase("K4_mixed_prefill", 2048, (2048, 512, 512), 16, (5, 2050, *[4] * 31), (-1, *range(32))),
    KernelCase("K5_batch1", 4096, (4096, 1024, 1024), 16, (1,), (7,)),
    KernelCase("K6_odd_dims", 1376, (96, 40, 40), 16, (0, 1, 15, 16, 17, 63, 64, 65, 0), (0, 1, -1, 2, 3, 4, 0, 1, 2),
               ("bfloat16", "float16", "float32"), ranks=(1, 3, 7, 13, 0)),
    KernelCase("K7_two_rank_blocks", 4096, (4096, 1024, 1024), 128, (32, 32), (0, 1), ranks=(100, 128)),
    KernelCase("K8_8b_down_32_adapters", 14336, (4096,), 64, (4,) * 32, tuple(range(32))),
    KernelCase("K9_all_base", 2048, (2048,), 16, (3, 5, 2), (-1, -1, -1)),
    KernelCase("K10_empty", 2048, (2048,), 16, (0, 0), (0, -1)),
    KernelCase("K11a_tp2_row_oproj", 1024, (2048,), 16, K1_LENS, K1_SLOTS),
    KernelCase("K11b_tp2_col_qkv", 2048, (1024, 256, 256), 16, K1_LENS, K1_SLOTS),
    KernelCase("K12_strided_y", 2048, (2048, 512, 512), 16, K1_LENS, K1_SLOTS, y_pad=16),
]
SMALL_CASES = ("K5_batch1", "K6_odd_dims", "K9_all_base")  # the sanitizer's run: tiny token counts


def _dry(case: KernelCase) -> KernelCase:
    """The same layout at interpreter size: dims shrunk (odd ones stay odd), few segments; bf16 runs as fp16."""
    in_dim = max(17, case.in_dim // 32 + (case.in_dim % 2))
    outs = tuple(max(8, o // 64) for o in case.slice_outs)
    lens, slots = case.seg_lens, case.seg_slots
    if len(lens) > 9:  # keep the base segment, a prefill if any, and 6 adapter segments
        lens, slots = lens[:8], slots[:8]
    lens = tuple(min(n, 70) for n in lens)
    dtypes = tuple(dict.fromkeys("float16" if d == "bfloat16" else d for d in case.dtypes))
    return replace(case, in_dim=in_dim, slice_outs=outs, seg_lens=lens, seg_slots=slots, dtypes=dtypes)


def _cases(ctx: Context, names: tuple[str, ...] | None = None) -> list[KernelCase]:
    cases = [c for c in GPU_CASES if names is None or c.name in names]
    if ctx.dry_run:
        keep = names or ("K1_decode_1b_qkv", "K6_odd_dims", "K7_two_rank_blocks", "K9_all_base", "K10_empty",
                         "K12_strided_y")
        cases = [_dry(c) for c in cases if c.name in keep]
    return cases


def _slot_ranks(case: KernelCase) -> list[int]:
    num_slots = max([s for s in case.seg_slots if s >= 0], default=0) + 1
    if case.ranks is not None:
        return list(case.ranks)
    ranks = [min(RANK_CYCLE[s % len(RANK_CYCLE)], case.max_rank) for s in range(num_slots)]
    if num_slots > 1:
        ranks[1] = 0  # one slot's adapter does not target this module
    return ranks


def make_inputs(case: KernelCase, dtype, device, seed: int = 0) -> dict:
    """x, the pool (zero past each slot's rank), y (maybe a view), segment metadata, as the LoRA layer passes them."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    ranks = _slot_ranks(case)
    num_slots, num_slices, out_total = len(ranks), len(case.slice_outs), sum(case.slice_outs)
    num_tokens = sum(case.seg_lens)

    def randn(*size, std=1.0):
        return (torch.randn(size, generator=gen, device=device) * std).to(dtype)

    lora_a = randn(num_slots, num_slices * case.max_rank, case.in_dim, std=case.in_dim**-0.5)
    lora_b = randn(num_slots, case.max_rank, out_total, std=case.max_rank**-0.5)
    for slot, r in enumerate(ranks):
        lora_a.view(num_slots, num_slices, case.max_rank, -1)[slot, :, r:] = 0
        lora_b[slot, r:] = 0
    y_full = randn(num_tokens, out_total + case.y_pad)
    return dict(
        x=randn(num_tokens, case.in_dim), lora_a=lora_a, lora_b=lora_b, y_full=y_full, y=y_full[:, case.y_pad:],
        seg_indptr=torch.tensor([0, *torch.tensor(case.seg_lens).cumsum(0).tolist()], dtype=torch.int32,
                                device=device),
        seg_slots=torch.tensor(case.seg_slots, dtype=torch.int32, device=device),
        slot_ranks=torch.tensor(ranks, dtype=torch.int32, device=device),
        slot_scales=torch.linspace(0.5, 2.0, num_slots, device=device, dtype=torch.float32),
        slice_offsets=torch.tensor([0, *torch.tensor(case.slice_outs).cumsum(0).tolist()], dtype=torch.int32,
                                   device=device),
        ranks=ranks,
    )


def serving_path(t: dict, device, num_slices: int):
    """The Triton backend as every LoRA linear calls it (kernels/backend.py), on make_inputs' tensors: the backend,
    its per-batch meta and the pool weights."""
    from types import SimpleNamespace

    from loraplex.kernels.backend import TritonBackend

    backend = TritonBackend(device)
    meta = backend.prepare(t["seg_indptr"].tolist(), t["seg_slots"].tolist())
    offsets = tuple(t["slice_offsets"].tolist())
    weights = SimpleNamespace(
        lora_a=t["lora_a"], lora_b=t["lora_b"], slice_offsets=t["slice_offsets"], row_offsets=offsets,
        slot_ranks=t["slot_ranks"], slot_scales=t["slot_scales"], host_ranks=list(t["ranks"]),
        host_scales=t["slot_scales"].tolist(), num_slices=num_slices,
    )  # fmt: skip
    return backend, meta, weights


def _references(case: KernelCase, t: dict, h, y0_full) -> tuple:
    """fp64 h_ref, and y_ref from the kernel's own h; plus the masks of what must stay exactly zero / unchanged."""
    import torch

    num_slices, max_rank = len(case.slice_outs), case.max_rank
    tokens = t["x"].shape[0]
    h_ref = torch.zeros(tokens, num_slices * max_rank, dtype=torch.float64, device=h.device)
    y_ref = y0_full[:, case.y_pad:].double().clone()
    h_must_be_zero = torch.ones_like(h, dtype=torch.bool)
    offsets = t["slice_offsets"].tolist()
    start = 0
    for length, slot in zip(case.seg_lens, case.seg_slots, strict=True):
        rows = slice(start, start + length)
        start += length
        r = t["ranks"][slot] if slot >= 0 else 0
        if length == 0 or r == 0:
            continue
        scale = float(t["slot_scales"][slot])
        for s in range(num_slices):
            cols = slice(s * max_rank, s * max_rank + r)
            h_ref[rows, cols] = t["x"][rows].double() @ t["lora_a"][slot, cols].double().T
            h_must_be_zero[rows, cols] = False
            out = slice(offsets[s], offsets[s + 1])
            y_ref[rows, out] += scale * (h[rows, cols].double() @ t["lora_b"][slot, :r, out].double())
    return h_ref, y_ref, h_must_be_zero


def _unchanged_rows(case: KernelCase, ranks: list[int]) -> list[int]:
    rows, start = [], 0
    for length, slot in zip(case.seg_lens, case.seg_slots, strict=True):
        if slot < 0 or ranks[slot] == 0:
            rows += range(start, start + length)
        start += length
    return rows


def run_case(ctx: Context, case: KernelCase, dtype_name: str, stalls: dict, worst: dict) -> None:
    import torch
    from loraplex.kernels import lora_expand_triton, lora_shrink_triton

    from tests.kernel_refs import lora_shrink_expand_torch

    dtype = getattr(torch, dtype_name)
    dev = ctx.device
    t = make_inputs(case, dtype, dev)
    y0_full = t["y_full"].clone()
    num_slices = len(case.slice_outs)
    meta = (t["seg_indptr"], t["seg_slots"], t["slot_ranks"])

    def shrink():
        return lora_shrink_triton(t["x"], t["lora_a"], *meta, num_slices)

    first_ms = wall_ms(shrink, dev)
    h = shrink()
    lora_expand_triton(t["y"], h, t["lora_b"], *meta, t["slot_scales"], t["slice_offsets"])
    if ctx.is_cuda:
        torch.cuda.synchronize()  # raises on an illegal access
    steady_ms = median([wall_ms(shrink, dev) for _ in range(ctx.reps(20))])
    stalls[f"{case.name}.{dtype_name}"] = round(first_ms - steady_ms, 2)

    h_ref, y_ref, h_zero = _references(case, t, h, y0_full)
    tol = TOLERANCE[dtype_name]
    problems = []
    if not (torch.isfinite(h).all() and torch.isfinite(t["y"]).all()):
        problems.append("NaN/Inf")
    err_h = max_rel_err(h[~h_zero], h_ref[~h_zero]) if (~h_zero).any() else 0.0
    err_y = max_rel_err(t["y"], y_ref) if t["y"].numel() else 0.0
    if (h[h_zero] != 0).any():
        problems.append("h nonzero on base rows / past rank")
    still = _unchanged_rows(case, t["ranks"])
    if still and not torch.equal(t["y"][still], y0_full[still, case.y_pad:]):
        problems.append("y changed on base/rank-0 rows")
    if case.y_pad and not torch.equal(t["y_full"][:, : case.y_pad], y0_full[:, : case.y_pad]):
        problems.append("y changed outside its view")
    # tol·max|ref| + 1e-6 as a relative error
    ok = not problems and err_h <= tol + 1e-6 and err_y <= tol + 1e-6
    name = f"{case.name}.{dtype_name}"
    ctx.rec.check(name, ok, {"h": err_h, "y": err_y}, tol, "; ".join(problems) or f"{sum(case.seg_lens)} tokens")
    if dtype_name == ("float16" if ctx.dry_run else "bfloat16"):
        if max(err_h, err_y) > worst.get("err", -1.0):
            worst.update(err=max(err_h, err_y), case=name)
    # the serving path: split-K planes left uninitialized and summed by the expand, vector access in the expand
    y_serving = y0_full[:, case.y_pad :].clone()
    backend, batch_meta, weights = serving_path(t, dev, num_slices)
    backend.shrink_expand(y_serving, t["x"], weights, batch_meta)
    if ctx.is_cuda:
        torch.cuda.synchronize()
    err = max_rel_err(y_serving, y_ref) if y_serving.numel() else 0.0
    unchanged = not still or torch.equal(y_serving[still], y0_full[still, case.y_pad :])
    ctx.rec.check(f"{name}.serving_path", unchanged and err <= tol + 1e-6, err, tol,
                  "backend.shrink_expand" + ("" if unchanged else "; y changed on base/rank-0 rows"))  # fmt: skip
    if dtype_name == "float32" and case.name.startswith(("K1", "K6")):
        y_torch = y0_full[:, case.y_pad:].clone()
        lora_shrink_expand_torch(y_torch, t["x"], t["lora_a"], t["lora_b"], *meta, t["slot_scales"],
                                 t["slice_offsets"])
        err = max_rel_err(t["y"], y_torch)
        ctx.rec.check(f"{name}.vs_lora_torch", err <= tol + 1e-6, err, tol, "the project's own oracle, same device")


def _compiled_variants() -> int | None:
    from loraplex.kernels.lora_expand import _expand_kernel
    from loraplex.kernels.lora_shrink import _shrink_kernel

    total = 0
    for kernel in (_shrink_kernel, _expand_kernel):
        caches = getattr(kernel, "device_caches", None)
        if caches is None:  # the interpreter keeps none
            return None
        total += sum(len(entry[0]) for entry in caches.values())
    return total


def _run_cases(ctx: Context, cases: list[KernelCase]) -> None:
    stalls: dict[str, float] = {}
    worst: dict = {}
    for case in cases:
        for dtype_name in case.dtypes:
            run_case(ctx, case, dtype_name, stalls, worst)
    ctx.rec.figure("first_call_minus_median_ms", stalls)
    ctx.rec.figure("worst_rel_err", worst)
    ctx.rec.figure("compiled_variants", _compiled_variants())
    ctx.rec.figure("worst_first_call_ms", max(stalls.values(), default=None))


def g1_kernels(ctx: Context) -> None:
    _run_cases(ctx, _cases(ctx))
    check_gated_delta(ctx)


def kernels_small(ctx: Context) -> None:
    _run_cases(ctx, _cases(ctx, SMALL_CASES))
    check_gated_delta(ctx, small=True)


# ---- G6: kernel perf ---------------------------------------------------------------------------------------------

PERF_MODULES = {  # name -> (in_dim, slice outs)
    "1b_qkv": (2048, (2048, 512, 512)),
    "1b_down": (8192, (2048,)),
    "8b_qkv": (4096, (4096, 1024, 1024)),
    "8b_gate_up": (4096, (14336, 14336)),
    "8b_down": (14336, (4096,)),
}
PERF_LAYOUTS = {  # name -> (segment length, adapters)
    "1x1": (1, 1), "32=8x4": (4, 8), "128=32x4": (4, 32), "2048x1": (2048, 1), "4096=8x512": (512, 8),
}


def _perf_cell(ctx: Context, module: str, layout: str, rank: int) -> dict:
    import torch
    import torch.nn.functional as F
    from loraplex.kernels import lora_shrink
    from loraplex.kernels.lora_expand import column_alignment, launch_expand
    from loraplex.kernels.lora_shrink import launch_shrink, shrink_output, split_k

    in_dim, outs = PERF_MODULES[module]
    seg_len, adapters = PERF_LAYOUTS[layout]
    if ctx.dry_run:
        in_dim, outs, seg_len = max(17, in_dim // 128), tuple(max(8, o // 256) for o in outs), min(seg_len, 4)
    case = KernelCase(module, in_dim, outs, rank, (seg_len,) * adapters, tuple(range(adapters)),
                      ranks=(rank,) * adapters)
    dtype = torch.float16 if ctx.dry_run else torch.bfloat16
    dev, reps, warm = ctx.device, ctx.reps(), ctx.warmups()
    t = make_inputs(case, dtype, dev)
    meta = (t["seg_indptr"], t["seg_slots"], t["slot_ranks"])
    num_slices, tokens = len(outs), seg_len * adapters
    # The serving path's launches (kernels/backend.py), each alone: the shrink into its split-K planes, the expand
    # summing them, and both as a LoRA linear calls them.
    backend, batch_meta, weights = serving_path(t, dev, num_slices)
    planes = shrink_output(t["x"], t["lora_a"])
    tiles, col_align = batch_meta.plan, column_alignment(weights.row_offsets)

    def shrink():
        launch_shrink(t["x"], t["lora_a"], planes, *meta[:2], t["slot_ranks"], num_slices, tiles)

    shrink_us = median(time_ms(shrink, dev, reps=reps, warmups=warm)) * 1e3
    expand_us = median(time_ms(lambda: launch_expand(t["y"], planes, t["lora_b"], *meta, t["slot_scales"],
                                                     t["slice_offsets"], tiles, col_align),
                               dev, reps=reps, warmups=warm)) * 1e3  # fmt: skip
    num_splits = split_k(tokens, in_dim)[1]
    no_split_us = shrink_us
    if num_splits > 1:  # the same shrink with split-K off: what the split gains
        saved = lora_shrink.SPLIT_K_MAX_TOKENS
        lora_shrink.SPLIT_K_MAX_TOKENS = -1
        try:
            whole = shrink_output(t["x"], t["lora_a"])
            no_split_us = median(time_ms(
                lambda: launch_shrink(t["x"], t["lora_a"], whole, *meta[:2], t["slot_ranks"], num_slices, tiles),
                dev, reps=reps, warmups=warm)) * 1e3  # fmt: skip
        finally:
            lora_shrink.SPLIT_K_MAX_TOKENS = saved

    def fused():
        backend.shrink_expand(t["y"], t["x"], weights, batch_meta)

    both_us = median(time_ms(fused, dev, reps=reps, warmups=warm)) * 1e3
    weight = torch.randn(sum(outs), in_dim, device=dev, dtype=dtype)
    base_us = median(time_ms(lambda: F.linear(t["x"], weight), dev, reps=reps, warmups=warm)) * 1e3

    def naive():  # per-segment addmm loop, the obvious torch baseline
        for s in range(adapters):
            rows = slice(s * seg_len, (s + 1) * seg_len)
            hs = t["x"][rows] @ t["lora_a"][s].T
            t["y"][rows] += hs[:, :rank] @ t["lora_b"][s, :rank]

    naive_us = median(time_ms(naive, dev, reps=reps, warmups=warm)) * 1e3
    calls = 200 if ctx.is_cuda else 3
    if ctx.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fused()
    enqueue_us = (time.perf_counter() - start) / calls * 1e6
    if ctx.is_cuda:
        torch.cuda.synchronize()
    s = dtype.itemsize
    shrink_bytes = adapters * num_slices * rank * in_dim * s + tokens * in_dim * s + tokens * num_slices * rank * s
    expand_bytes = adapters * rank * sum(outs) * s + tokens * num_slices * rank * s + 2 * tokens * sum(outs) * s
    copy_gbps = ctx.ceilings.get("copy_GBps") or float("nan")
    shrink_gbps, expand_gbps = shrink_bytes / shrink_us / 1e3, expand_bytes / expand_us / 1e3
    return {"shrink_us": shrink_us, "expand_us": expand_us, "shrink_expand_us": both_us, "base_us": base_us,
            "splits": num_splits, "shrink_no_split_us": no_split_us, "col_align": col_align,
            "naive_us": naive_us, "enqueue_us": enqueue_us, "shrink_GBps": shrink_gbps, "expand_GBps": expand_gbps,
            "shrink_pct_copy": 100 * shrink_gbps / copy_gbps, "expand_pct_copy": 100 * expand_gbps / copy_gbps}


def g6_kernel_perf(ctx: Context) -> None:
    cells: dict[str, dict] = {}
    grid = [(m, lay, r) for m in PERF_MODULES for lay in PERF_LAYOUTS for r in (16, 64)]
    if ctx.dry_run:  # the code path once, not the sweep: interpreter timings mean nothing
        grid = [("8b_down", "128=32x4", 64), ("1b_qkv", "32=8x4", 16)]
    for module, layout, rank in grid:
        cells[f"{module}|{layout}|r{rank}"] = _perf_cell(ctx, module, layout, rank)
        ctx.rec.figure("cells", cells)
    if ctx.dry_run:
        ctx.rec.skip("perf_flags", "dry-run: interpreter timings mean nothing")
        ctx.rec.check("cells_measured", len(cells) == len(grid), len(cells), len(grid))
        return
    down = cells["8b_down|128=32x4|r64"]
    ctx.rec.flag("SLOW_SHRINK", down["shrink_pct_copy"] < 40, down["shrink_pct_copy"], 40, "8B down, 128 tok, r64, %")
    gate_up = cells["8b_gate_up|128=32x4|r64"]
    ctx.rec.flag("SLOW_EXPAND", gate_up["expand_pct_copy"] < 30, gate_up["expand_pct_copy"], 30,
                 "8B gate_up, 128 tok, r64, % of copy BW")
    one = cells["8b_down|1x1|r64"]["shrink_us"]
    ctx.rec.flag("NO_SPLIT_K", one > 15, one, 15, "8B down, 1 token, r64 shrink µs")
    ratios = {m: cells[f"{m}|32=8x4|r16"]["shrink_expand_us"] / cells[f"{m}|32=8x4|r16"]["base_us"]
              for m in PERF_MODULES}
    worst = max(ratios, key=ratios.get)
    ctx.rec.flag("LORA_VS_BASE", ratios[worst] > 0.5, ratios[worst], 0.5,
                 f"LoRA/base at 32 tok, 8 adapters, r16: {worst}")
    enqueue = max(c["enqueue_us"] for c in cells.values())
    ctx.rec.flag("LAUNCH_OVERHEAD", enqueue > 40, enqueue, 40, "host µs per backend.shrink_expand call (worst cell)")
    ctx.rec.figure("headline", {"shrink_GBps": down["shrink_GBps"], "shrink_pct": down["shrink_pct_copy"],
                                "expand_GBps": gate_up["expand_GBps"], "expand_pct": gate_up["expand_pct_copy"],
                                "down_1tok_r64_us": one, "enqueue_us": enqueue,
                                "down_1tok_r64_no_split_us": cells["8b_down|1x1|r64"]["shrink_no_split_us"]})
