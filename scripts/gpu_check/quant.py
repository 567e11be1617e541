"""Group G9 (quantized linears) of scripts/gpu_check/runner.py: each quantized matmul path the worker takes on CUDA (the
Triton INT4/INT8/FP8 kernels of kernels/quant_matmul.py, torch._scaled_mm for W8A8 FP8, MXFP4 experts'
kernels/mxfp4_matmul.py), built through the worker's own layouts (worker/quant/matmul.py; one expert's codes), against
the dequantized weight's torch matmul in bf16, and timed beside the plain bf16 matmul on the same shape. On a CPU dry
run the Triton kernels run in the interpreter at tiny shapes in fp16 (the interpreter's bf16 dot is wrong) and
_scaled_mm runs torch's CPU implementation."""

from __future__ import annotations

from scripts.gpu_check.lib import Context, max_rel_err, median, time_ms

# name -> (out, in): a Llama-3-8B layer's fused qkv and its down projection; the dry run's stand-ins
MODULES = {"8b_qkv": (6144, 4096), "8b_down": (4096, 14336)}
DRY_MODULES = {"8b_qkv": (96, 128), "8b_down": (64, 256)}
# MXFP4 experts (kernels/mxfp4_matmul.py, one expert per launch): gpt-oss-20b's down projection of one expert
MXFP4_MODULES = {"20b_down": (2880, 2880)}
DRY_MXFP4_MODULES = {"20b_down": (48, 96)}  # tails in rows and the last K tile
BATCHES = (1, 32)  # decode batch 1 and 32
PATHS = ("int4-g128", "int8-channel", "fp8-block128", "fp8-channel-scaled-mm", "fp8-tensor-scaled-mm")
TOLERANCE = {"bfloat16": 8e-3, "float16": 2e-3}  # as G1: output rounding, relative to the largest |ref|
# _scaled_mm against the unquantized activations: e4m3 rounds each activation by up to 2^-4 of itself; per token,
# relative to the token's largest output
FP8_ACTIVATION_TOLERANCE = 0.08


class _Mxfp4Weight:
    """One MXFP4 expert's codes and scales (worker/quant/mxfp4.py), dequantized as the CPU path does."""

    def __init__(self, blocks, scales):
        self.blocks, self.scales = blocks, scales

    def dequantize(self, rows: slice, dtype):
        from loraplex.worker.quant import mxfp4

        return mxfp4.dequantize(self.blocks[rows], self.scales[rows], dtype)


class _Mxfp4Matmul:
    """ExpertsLinear's CUDA path for one expert: kernels/mxfp4_matmul.py on the resident codes."""

    def __init__(self, weight: _Mxfp4Weight, dtype):
        self.weight = weight
        self.nbytes = weight.blocks.numel() + weight.scales.numel()

    def __call__(self, x):
        from loraplex.kernels.mxfp4_matmul import mxfp4_weight_matmul_triton

        return mxfp4_weight_matmul_triton(x, self.weight.blocks, self.weight.scales)


def _weight(path: str, num_rows: int, num_cols: int, device, seed: int):
    """A random weight in the path's form, as a checkpoint would decode it (worker/quant/weights.py)."""
    import torch
    from loraplex.worker.quant.weights import FloatWeight, IntWeight

    gen = torch.Generator(device=device).manual_seed(seed)
    if path == "mxfp4":  # every code; exponents 2^-8 .. 2^-5, gpt-oss's weights' range
        blocks = torch.randint(0, 256, (num_rows, num_cols // 2), generator=gen, device=device, dtype=torch.uint8)
        scales = torch.randint(119, 123, (num_rows, num_cols // 32), generator=gen, device=device, dtype=torch.uint8)
        return _Mxfp4Weight(blocks, scales)
    if path.startswith("int"):
        bits, group_size = (4, 128) if path == "int4-g128" else (8, num_cols)
        num_groups = num_cols // group_size
        q = torch.randint(0, 2**bits, (num_rows, num_cols), generator=gen, device=device, dtype=torch.uint8)
        zeros = torch.randint(0, 2**bits, (num_rows, num_groups), generator=gen, device=device, dtype=torch.int32)
        scales = torch.rand(num_rows, num_groups, generator=gen, device=device) * 0.02 / 2**bits + 1e-4
        return IntWeight(q=q, scales=scales, zeros=zeros, g_idx=None, group_size=group_size, bits=bits)
    q = (torch.randn(num_rows, num_cols, generator=gen, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    if path == "fp8-block128":  # weight-only 128x128 blocks (compressed-tensors FP8 block)
        scales = torch.rand(-(-num_rows // 128), -(-num_cols // 128), generator=gen, device=device) * 2e-4 + 1e-5
        return FloatWeight.blocked(q, scales, 128, 128).to(device)  # ids made on the host
    rows = num_rows if path == "fp8-tensor-scaled-mm" else 1  # W8A8 per tensor or per channel
    scales = torch.rand(num_rows // rows, 1, generator=gen, device=device) * 2e-4 + 1e-5
    return FloatWeight.blocked(q, scales, rows, num_cols, w8a8=True).to(device)


def _layout(path: str, weight, dtype):
    from loraplex.worker.quant.matmul import ScaledMMFP8Matmul, TritonFP8Matmul, TritonIntMatmul

    if path == "mxfp4":
        return _Mxfp4Matmul(weight, dtype)
    kind = TritonIntMatmul if path.startswith("int") else ScaledMMFP8Matmul if "scaled-mm" in path else TritonFP8Matmul
    return kind(weight, dtype)


def _cell(ctx: Context, path: str, module: str, shape: tuple[int, int], num_tokens: int, dtype_name: str,
          cells: dict) -> None:
    import torch
    import torch.nn.functional as F
    from loraplex.worker.quant.scaled_mm import quantize_activations

    dtype, dev = getattr(torch, dtype_name), ctx.device
    weight = _weight(path, *shape, dev, seed=len(cells))
    matmul = _layout(path, weight, dtype)
    w32 = weight.dequantize(slice(None), torch.float32)  # (out, in)
    w_plain = w32.to(dtype)  # the plain (bf16) model's weight: the reference and the timing baseline
    x = torch.randn(num_tokens, shape[1], device=dev, generator=torch.Generator(device=dev).manual_seed(7)).to(dtype)
    name = f"{path}|{module}|B{num_tokens}"
    y = matmul(x)
    if ctx.is_cuda:
        torch.cuda.synchronize()  # raises on an illegal access
    ref = F.linear(x, w_plain)  # the dequantized weight's torch matmul in the activation dtype
    finite = bool(torch.isfinite(y).all())
    if "scaled-mm" in path:
        # exactly what it computes: the activations as it quantizes them, times the weight, rounded once
        x_q, x_scale = quantize_activations(x, per_token=not matmul.per_tensor)
        emulated = F.linear(x_q.float() * x_scale, w32)
        err = max_rel_err(y, emulated)
        row_err = float(((y.double() - ref.double()).abs().amax(-1) / ref.double().abs().amax(-1)).max())
        tol = TOLERANCE[dtype_name if matmul.per_tensor else "bfloat16"]  # row-wise scaling writes bf16
        ok = finite and err <= tol and row_err <= FP8_ACTIVATION_TOLERANCE
        ctx.rec.check(name, ok, {"vs_emulated": err, "per_token_vs_ref": row_err},
                      {"vs_emulated": tol, "per_token_vs_ref": FP8_ACTIVATION_TOLERANCE},
                      f"{type(matmul).__name__} {'tensor' if matmul.per_tensor else 'row'}-wise"
                      + ("" if finite else "; NaN/Inf"))  # fmt: skip
    else:
        err = max_rel_err(y, ref)
        ctx.rec.check(name, finite and err <= TOLERANCE[dtype_name], err, TOLERANCE[dtype_name],
                      type(matmul).__name__ + ("" if finite else "; NaN/Inf"))  # fmt: skip
    reps, warm = ctx.reps(), ctx.warmups()
    us = median(time_ms(lambda: matmul(x), dev, reps=reps, warmups=warm)) * 1e3
    plain_us = median(time_ms(lambda: F.linear(x, w_plain), dev, reps=reps, warmups=warm)) * 1e3
    copy_gbps = ctx.ceilings.get("copy_GBps") or float("nan")
    gbps = matmul.nbytes / us / 1e3  # the weight's resident bytes read once per call
    cells[name] = {"us": us, "plain_us": plain_us, "speedup_vs_plain": plain_us / us, "weight_bytes": matmul.nbytes,
                   "plain_weight_bytes": w_plain.numel() * w_plain.element_size(), "weight_GBps": gbps,
                   "pct_copy": 100 * gbps / copy_gbps, "err": err, "dtype": dtype_name}
    ctx.rec.figure("cells", cells)


def _selection(ctx: Context) -> None:
    """What build_matmul chooses on this device for each form: on compute capability 8.9+, _scaled_mm for W8A8."""
    import torch
    from loraplex.worker.quant.matmul import ScaledMMFP8Matmul, TritonFP8Matmul, TritonIntMatmul, choose_matmul

    dev = ctx.device
    capability = torch.cuda.get_device_capability(dev)
    expected = {
        "int4-g128": TritonIntMatmul, "int8-channel": TritonIntMatmul, "fp8-block128": TritonFP8Matmul,
        "fp8-channel-scaled-mm": ScaledMMFP8Matmul if capability >= (8, 9) else TritonFP8Matmul,
        "fp8-tensor-scaled-mm": ScaledMMFP8Matmul if capability >= (8, 9) else TritonFP8Matmul,
    }  # fmt: skip
    chosen = {path: choose_matmul(_weight(path, 256, 256, dev, 0), dev, torch.bfloat16).__name__ for path in PATHS}
    ctx.rec.figure("chosen", chosen)
    want = {path: kind.__name__ for path, kind in expected.items()}
    ctx.rec.check("kernel_choice", chosen == want, chosen, want, f"compute capability {capability}")


def g9_quantized(ctx: Context) -> None:
    modules = DRY_MODULES if ctx.dry_run else MODULES
    dtype_name = "float16" if ctx.dry_run else "bfloat16"  # the interpreter's bf16 dot is wrong
    if ctx.skip_unless_cuda("kernel_choice"):
        _selection(ctx)
    cells: dict[str, dict] = {}
    mxfp4_modules = DRY_MXFP4_MODULES if ctx.dry_run else MXFP4_MODULES
    for path, path_modules in [*((p, modules) for p in PATHS), ("mxfp4", mxfp4_modules)]:
        for module, shape in path_modules.items():
            for num_tokens in BATCHES:
                try:
                    _cell(ctx, path, module, shape, num_tokens, dtype_name, cells)
                except Exception as e:  # one path's failure is its check's, not the group's
                    ctx.rec.check(f"{path}|{module}|B{num_tokens}", False, None, None, f"{type(e).__name__}: {e}"[:300])
    ctx.rec.figure("headline", _headline(cells))
    if ctx.dry_run:
        ctx.rec.skip("QUANT_DECODE_SLOW", "dry-run: interpreter timings mean nothing")
        return
    ratios = {name: cell["speedup_vs_plain"] for name, cell in cells.items() if name.endswith("|B1")}
    if ratios:
        slowest = min(ratios, key=ratios.get)
        ctx.rec.flag("QUANT_DECODE_SLOW", ratios[slowest] < 1.0, ratios[slowest], 1.0,
                     f"bf16 µs / quantized µs at batch 1, slowest: {slowest}")  # fmt: skip


def _headline(cells: dict[str, dict]) -> dict:
    """The reviewer's line: each path's µs on the 8B down projection at batch 1 beside bf16's, the worst errors."""
    down = {name.split("|")[0]: cell for name, cell in cells.items() if name.endswith("|8b_down|B1")}
    errors = {"triton": [c["err"] for n, c in cells.items() if "scaled-mm" not in n],
              "scaled_mm": [c["err"] for n, c in cells.items() if "scaled-mm" in n]}
    return {"down_B1_us": {path: cell["us"] for path, cell in down.items()},
            "down_B1_plain_us": median([cell["plain_us"] for cell in down.values()]),
            "worst_err": {kind: max(errs, default=None) for kind, errs in errors.items()}}
