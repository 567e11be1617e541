"""G1's Gated DeltaNet part (kernels/gated_delta.py, run by the hybrid layers on CUDA): the Triton conv and delta rule,
launched as the layer's Triton mixer launches them, against the torch mixer on the same device from the same inputs,
at Qwen3-Next-80B's shape per rank in bf16 with the state slots in bf16 and in fp32: a batch of decodes (the one-token
launches) and a mixed batch of decodes and prompts (the varlen launches; one prompt of 1000 tokens), each request in a
scattered slot. Then both mixers timed on a decode batch and a prefill. On a CPU dry run: a tiny shape in fp16 in the
interpreter (its bf16 dot is wrong), the state slots in fp16 only, no timings; in the sanitizer's run (kernels_small)
the same tiny shape in bf16, untimed."""

from __future__ import annotations

from scripts.gpu_check.lib import Context, max_rel_err, median, time_ms

SHAPE = (16, 32, 128, 128, 4)  # key heads, value heads, dk, dv, conv kernel: Qwen3-Next-80B-A3B's (and Qwen3.5's)
DRY_SHAPE = (2, 4, 16, 24, 4)
BATCHES = {"decode32": [1] * 32, "mixed": [1] * 8 + [300, 37, 64, 1000]}
DRY_BATCHES = {"decode3": [1] * 3, "mixed": [1, 1, 20, 3]}
TIMED = {"decode32": [1] * 32, "prefill4x512": [512] * 4}
TOLERANCE = {"bfloat16": 8e-3, "float16": 2e-3}  # as the LoRA kernels': output rounding, relative to max |ref|


def _inputs(shape: tuple[int, ...], num_new: list[int], dtype, state_dtype, device, seed: int = 0) -> dict:
    import torch
    from loraplex.worker.state_cache import StateBatch

    key_heads, value_heads, dk, dv, kernel = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    channels, num_tokens, num_slots = 2 * key_heads * dk + value_heads * dv, sum(num_new), 2 * len(num_new) + 1

    def randn(*size, std=1.0, dt=dtype):
        return (torch.randn(size, generator=gen, device=device) * std).to(dt)

    slots = torch.randperm(num_slots, generator=gen, device=device)[: len(num_new)].tolist()  # scattered
    return dict(
        mixed=randn(num_tokens, channels),
        weight=randn(channels, kernel, std=0.5),
        conv_states=randn(num_slots, channels, kernel - 1, dt=state_dtype),
        states=randn(num_slots, value_heads, dk, dv, std=0.1, dt=state_dtype),
        g=-torch.rand(num_tokens, value_heads, generator=gen, device=device),  # decays in (1/e, 1]
        beta=torch.rand(num_tokens, value_heads, generator=gen, device=device).to(dtype),
        batch=StateBatch.of(slots, num_new, device),
        shape=shape,
    )


def _mix(mixer, t: dict, conv_states, states, conv_out=None):
    """The layer's two steps; the rule runs on `conv_out` when given (both mixers' rules from the same inputs)."""
    key_heads, value_heads, dk, dv, _ = t["shape"]
    own = mixer.conv(t["mixed"], conv_states, t["weight"], t["batch"])
    q, k, v = (own if conv_out is None else conv_out).split([key_heads * dk] * 2 + [value_heads * dv], dim=-1)
    num_tokens = q.shape[0]
    out = mixer.rule(q.view(num_tokens, key_heads, dk), k.view(num_tokens, key_heads, dk),
                     v.view(num_tokens, value_heads, dv), t["g"], t["beta"], states, t["batch"])  # fmt: skip
    return own, out


def _check(ctx: Context, name: str, t: dict, dtype_name: str, worst: dict) -> None:
    import torch
    from loraplex.worker.layers.delta_mixer import TorchDeltaMixer, TritonDeltaMixer

    ref_conv_states, ref_states = t["conv_states"].clone(), t["states"].clone()
    ref_conv, ref_out = _mix(TorchDeltaMixer(), t, ref_conv_states, ref_states)
    conv, out = _mix(TritonDeltaMixer(), t, t["conv_states"], t["states"], conv_out=ref_conv)
    if ctx.is_cuda:
        torch.cuda.synchronize()  # raises on an illegal access
    errors = {"conv": max_rel_err(conv, ref_conv), "conv_states": max_rel_err(t["conv_states"], ref_conv_states),
              "out": max_rel_err(out, ref_out), "states": max_rel_err(t["states"], ref_states)}  # fmt: skip
    finite = all(bool(torch.isfinite(x).all()) for x in (conv, out, t["states"]))
    tol = TOLERANCE[dtype_name]
    ctx.rec.check(name, finite and max(errors.values()) <= tol, errors, tol,
                  f"{sum(t['batch'].num_new)} tokens, {len(t['batch'].num_new)} requests"
                  + ("" if finite else "; NaN/Inf"))  # fmt: skip
    if max(errors.values()) > worst.get("err", -1.0):
        worst.update(err=max(errors.values()), case=name)


def _timings(ctx: Context, dtype) -> dict:
    from loraplex.worker.layers.delta_mixer import TorchDeltaMixer, TritonDeltaMixer

    figures = {}
    for name, num_new in TIMED.items():
        t = _inputs(SHAPE, num_new, dtype, dtype, ctx.device, seed=1)
        for mixer in (TorchDeltaMixer(), TritonDeltaMixer()):
            ms = time_ms(lambda m=mixer, t=t: _mix(m, t, t["conv_states"], t["states"]), ctx.device,
                         reps=ctx.reps(10), warmups=ctx.warmups())  # fmt: skip
            figures[f"{name}.{mixer.name}_us"] = round(median(ms) * 1e3, 1)
    return figures


def check_gated_delta(ctx: Context, small: bool = False) -> None:
    """small: the sanitizer's run (kernels_small), the dry run's shapes and batches in bf16, untimed."""
    import torch

    dtype_name = "float16" if ctx.dry_run else "bfloat16"
    dtype = getattr(torch, dtype_name)
    tiny = ctx.dry_run or small
    shape, batches = (DRY_SHAPE, DRY_BATCHES) if tiny else (SHAPE, BATCHES)
    worst: dict = {}
    for state_dtype in (dtype,) if tiny else (dtype, torch.float32):
        for batch_name, num_new in batches.items():
            name = f"gated_delta.{batch_name}.{dtype_name}.state_{str(state_dtype).removeprefix('torch.')}"
            try:
                _check(ctx, name, _inputs(shape, num_new, dtype, state_dtype, ctx.device), dtype_name, worst)
            except Exception as e:  # one case's failure is its check's, not the group's
                ctx.rec.check(name, False, None, None, f"{type(e).__name__}: {e}"[:300])
    ctx.rec.figure("gated_delta_worst_rel_err", worst)
    if small:
        return
    if ctx.dry_run:
        ctx.rec.skip("DELTA_PREFILL_SLOW", "dry-run: interpreter timings mean nothing")
        return
    figures = _timings(ctx, dtype)
    ctx.rec.figure("gated_delta_us", figures)
    ratio = figures["prefill4x512.triton_us"] / figures["prefill4x512.torch_us"]
    detail = "Triton (fused recurrent) / torch (chunked) µs, prefill 4 x 512: above 1, write the chunked kernel"
    ctx.rec.flag("DELTA_PREFILL_SLOW", ratio > 1.0, ratio, 1.0, detail)
