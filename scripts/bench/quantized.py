"""Decode on a quantized base: INT8 and INT4 copies of the bench model against its plain weights.

    python -m scripts.bench quantized                 # full: the bench model
    python -m scripts.bench quantized --quick --json out.json

The bench model's linears are written as compressed-tensors INT8 per channel (W8A16) and GPTQ INT4 in groups of 128
(tests/quantize_checkpoint.py; groups of 64 where 128 does not divide a layer), and each checkpoint decodes one
request alone and a batch of 32 requests on 32 different adapters in this process (scripts/bench/decode_step.py's
ModelRunner, the requests' mean context), activations in --dtype (bf16 by default, as the plain side's weights): the
median step of each, alternating the three per repeat, and each one's resident linear weight bytes. Ratios: plain
step / INT8 step and plain step / INT4 step, single stream and 32 adapters (above 1: the quantized base is faster).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from loraplex.worker.model_runner import ModelRunner

from scripts.bench.decode_step import decode_reqs, make_runner, step_ms
from scripts.bench.model import BenchModel, build_atomically
from scripts.bench.report import Targets
from scripts.bench.server import worker_threads
from tests.quantize_checkpoint import write_quantized

NUM_WARMUP_STEPS = 4
VARIANTS = {"plain": None, "int8": "ct-w8a16", "int4": "gptq-4bit"}  # label -> tests/quantize_checkpoint.py format


@dataclass(frozen=True)
class Plan:
    size: str
    num_adapters: int  # in the bench model: the batch's requests each use their own
    context: int  # tokens in the KV cache when the timed steps run
    num_steps: int  # timed steps per repeat


FULL = Plan(size="full", num_adapters=32, context=128, num_steps=64)
QUICK = Plan(size="quick", num_adapters=4, context=32, num_steps=16)
BATCHES = {"single": 1, "adapters": None}  # label -> decode batch (None: one request per adapter of the plan)

TARGETS: Targets = {
    "int8_single": ("single-stream decode step, plain / INT8 W8A16 base (one adapter)", ">= 1", lambda v: v >= 1),
    "int4_single": ("single-stream decode step, plain / INT4 W4A16 base (one adapter)", ">= 1", lambda v: v >= 1),
    "int8_adapters": ("decode step of one request per adapter, plain / INT8 base", ">= 1", lambda v: v >= 1),
    "int4_adapters": ("decode step of one request per adapter, plain / INT4 base", ">= 1", lambda v: v >= 1),
}


def quantized_copies(bench: BenchModel) -> dict[str, BenchModel]:
    """label -> the bench model with its base in that form (written once next to the bench model)."""
    models = {}
    group_size = 128 if _divides(bench.base_dir, 128) else 64
    for label, fmt in VARIANTS.items():
        if fmt is None:
            models[label] = bench
            continue
        # named as published quantized checkpoints are (base-INT8): the adapters' base check takes it for the base
        out_dir = bench.base_dir.with_name(f"{bench.base_dir.name}-{label.upper()}")
        build_atomically(out_dir, lambda out, fmt=fmt: write_quantized(bench.base_dir, fmt, out, None, group_size))
        models[label] = replace(bench, base_dir=out_dir)
    return models


def _divides(model_dir: Path, group_size: int) -> bool:
    """Whether group_size divides every linear's input size (hidden, intermediate, heads × head_dim)."""
    config = json.loads((model_dir / "config.json").read_text())
    num_heads = config["num_attention_heads"]
    attention_size = num_heads * (config.get("head_dim") or config["hidden_size"] // num_heads)
    return all(size % group_size == 0 for size in (config["hidden_size"], config["intermediate_size"], attention_size))


def linear_bytes(runner: ModelRunner) -> int:
    """Resident bytes of the decoder's linear weights (quantized layout, or plain / oneDNN-packed / laid out for
    cpu_gemv), the LM head's included where it is not tied."""
    total = 0
    for module in runner.model.modules():
        quant = getattr(module, "quant", None)
        if quant is not None:
            total += quant.nbytes
        elif getattr(module, "gemv", None) is not None and not getattr(module, "tied", False):
            total += module.gemv.nbytes
        elif hasattr(module, "packed_weight") and not getattr(module, "tied", False):
            weight = module.packed_weight if module.packed_weight is not None else module.weight
            total += weight.numel() * weight.element_size() if weight.numel() else 0
    return total


def benchmark(bench: BenchModel, plan: Plan, *, dtype: str, server_threads: int, repeats: int, seed: int) -> dict:
    torch.set_num_threads(worker_threads(server_threads))
    models = quantized_copies(bench)
    steps: dict[str, dict[str, list[float]]] = {batch: {label: [] for label in models} for batch in BATCHES}
    linear_mib, kernels = {}, {}
    for batch_label, batch in BATCHES.items():
        batch = batch or plan.num_adapters
        runners = {label: make_runner(model, dtype=dtype, batch=batch, context=plan.context,
                                      max_loras_per_batch=batch, num_adapters=batch)
                   for label, model in models.items()}  # fmt: skip
        for _ in range(repeats):
            for label, (runner, pages) in runners.items():
                reqs = decode_reqs(pages, plan.context, list(range(batch)))
                times = [step_ms(runner, reqs, step) for step in range(NUM_WARMUP_STEPS + plan.num_steps)]
                steps[batch_label][label].append(statistics.median(times[NUM_WARMUP_STEPS:]))
        if not linear_mib:  # the same weights at every batch
            linear_mib = {label: linear_bytes(runner) / 2**20 for label, (runner, _) in runners.items()}
            kernels = {label: sorted({m.quant.matmul.name for m in runner.model.modules()
                                      if getattr(m, "quant", None) is not None})
                       for label, (runner, _) in runners.items()}  # fmt: skip
        del runners
    best = {batch: {label: min(values) for label, values in by_label.items()} for batch, by_label in steps.items()}
    result = {"step_ms": best, "batch": {"single": 1, "adapters": plan.num_adapters}, "linear_mib": linear_mib,
              "kernels": kernels}
    result["measured"] = measure_ratios(result)
    print(f"decode step ms {best}; linear weights MiB "
          f"{ {k: round(v, 1) for k, v in linear_mib.items()} }; kernels {kernels}")
    return result


def measure_ratios(results: dict) -> dict[str, tuple[float, str]]:
    mib = results["linear_mib"]
    measured = {}
    for batch_label, step in results["step_ms"].items():
        batch = results["batch"][batch_label]
        for label in ("int8", "int4"):
            measured[f"{label}_{batch_label}"] = (
                step["plain"] / step[label],
                f"{step['plain']:.2f} vs {step[label]:.2f} ms ({batch / step['plain'] * 1e3:.0f} vs "
                f"{batch / step[label] * 1e3:.0f} tok/s, batch {batch}); {mib['plain']:.0f} vs {mib[label]:.0f} MiB")
    return measured
