"""Model families beside the Llama rows: the same requests with 8 adapters and with none on a model of each family's
shape (scripts/bench/model.py SIZES), on this machine.

    python -m scripts.bench families                 # full: Qwen3- and Qwen3-MoE-shaped models, 64 requests
    python -m scripts.bench families --quick --json out.json

Per family, one server with 8 rank-16 all-module adapters (on a MoE: attention and every expert) preloaded runs the
workload on the 8 adapters (uniform), then the same requests on the base model alone, interleaved per repeat. Ratio:
output throughput 8 adapters / base (best of the repeats), as all.py's Llama row. A family is one entry of
FAMILY_SIZES.

Two families' caches beside them, in process: a hybrid model's decode step (Gated DeltaNet state update) against a
dense model of equal parameters (KV read) at 1, 8 and 32 running requests (scripts/bench/hybrid_decode.py's
measurement; --quick on its small shapes), and latent attention's KV bytes per token against the same model with
plain multi-head attention, on DeepSeek-V3's published shapes (DeepseekV3Config's defaults) through the worker's own
KV layout. And quantized experts (worker/layers/expert_weights.py), in process: the Qwen3-MoE-shaped bench model with
its attention, dense and expert linears in FP8 (128x128 blocks) and in compressed-tensors INT4 (groups of 64)
against its plain weights in --dtype: each one's resident expert bytes on one rank and its median decode step of one
request per adapter (scripts/bench/decode_step.py's runner, alternating the three per repeat).
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import scripts.bench.hybrid_decode as hybrid_decode
import scripts.bench.serving as bench_serving
from scripts.bench.decode_step import decode_reqs, make_runner, step_ms
from scripts.bench.model import SIZES, BenchModel, build_atomically, ensure_bench_model
from scripts.bench.report import Targets, best_of, versus
from scripts.bench.server import start_server
from scripts.bench.workload import WorkloadSpec, make_workload

# family -> its bench model size in SIZES (full plan, quick plan)
FAMILY_SIZES: dict[str, tuple[str, str]] = {
    "qwen3": ("qwen3", "qwen3-quick"),
    "qwen3_moe": ("qwen3_moe", "qwen3_moe-quick"),
}


@dataclass(frozen=True)
class Plan:
    size: str  # the first family's (what scripts/bench/ratios.py builds); each family builds its own below
    quick: bool
    num_adapters: int
    input_len_range: tuple[int, int]
    output_len_range: tuple[int, int]
    num_requests: int
    concurrency: int
    families: tuple[str, ...] = field(default=tuple(FAMILY_SIZES))
    hybrid_context: int = 256  # tokens each running request has before the timed decode steps
    hybrid_steps: int = 5  # timed steps per model and batch (the median is the figure)

    def family_size(self, family: str) -> str:
        return FAMILY_SIZES[family][1 if self.quick else 0]


FULL = Plan(size=FAMILY_SIZES["qwen3"][0], quick=False, num_adapters=8, input_len_range=(16, 128),
            output_len_range=(16, 128), num_requests=64, concurrency=16)
QUICK = Plan(size=FAMILY_SIZES["qwen3"][1], quick=True, num_adapters=8, input_len_range=(8, 16),
             output_len_range=(4, 8), num_requests=16, concurrency=8, hybrid_context=16, hybrid_steps=2)
HYBRID_BATCHES = (1, 8, 32)  # running requests per timed decode step
QUANTIZED_EXPERTS = {"fp8": "fp8-block", "int4": "ct-w4a16"}  # label -> tests/quantize_checkpoint.py format
EXPERTS_GROUP_SIZE = 64  # divides every linear's input in both MoE sizes


TARGETS: Targets = {
    f"{family}_multi_vs_base": (f"{family}-shaped: {{num_adapters}}-adapter / base-only throughput "
                                "({concurrency} concurrent)", ">= 0.8", lambda v: v >= 0.8)
    for family in FAMILY_SIZES
} | {
    f"hybrid_decode_{batch}": (f"hybrid / dense decode step, equal parameters, {batch} running ({{hybrid_context}} "
                               "tokens of context)", "<= 1", lambda v: v <= 1)
    for batch in HYBRID_BATCHES
} | {
    "latent_kv_bytes": ("latent / plain attention KV bytes per token (DeepSeek-V3's shapes)", "<= 0.1",
                        lambda v: v <= 0.1),
    "moe_fp8_expert_bytes": ("Qwen3-MoE-shaped: FP8-block / plain ({dtype}) resident expert bytes", "<= 0.55",
                             lambda v: v <= 0.55),
    "moe_int4_expert_bytes": ("Qwen3-MoE-shaped: INT4 / plain ({dtype}) resident expert bytes", "<= 0.3",
                              lambda v: v <= 0.3),
    "moe_fp8_decode": ("Qwen3-MoE-shaped decode step, plain / FP8-block experts ({num_adapters} adapters)", ">= 0.5",
                       lambda v: v >= 0.5),
    "moe_int4_decode": ("Qwen3-MoE-shaped decode step, plain / INT4 experts ({num_adapters} adapters)", ">= 0.5",
                        lambda v: v >= 0.5),
}


def benchmark(bench: BenchModel, plan: Plan, *, dtype: str, server_threads: int, repeats: int, seed: int) -> dict:
    """Per family: {'size', 'adapters', 'base'} (best runs); 'measured' ratios. Each family's bench model is built
    beside `bench` (in the same cache directory)."""
    cache_dir = bench.base_dir.parent.parent
    results: dict = {"plan": {**plan.__dict__, "families": list(plan.families), "dtype": dtype}, "families": {}}
    for family in plan.families:
        size = plan.family_size(family)
        model = ensure_bench_model(SIZES[size], plan.num_adapters, cache_dir)
        adapters = WorkloadSpec(num_requests=plan.num_requests, input_len_range=plan.input_len_range,
                                output_len_range=plan.output_len_range, adapter_names=tuple(model.adapter_dirs),
                                seed=seed)
        base = replace(adapters, adapter_names=())
        runs: dict[str, list[dict]] = {"adapters": [], "base": []}
        with start_server(model.base_dir, model.adapter_dirs, dtype=dtype, server_threads=server_threads,
                          max_running_requests=plan.concurrency, max_loras_per_batch=plan.num_adapters) as server:
            for i in range(repeats):  # interleaved, so that a slow spell of the machine hits both sides alike
                for side, spec in (("adapters", adapters), ("base", base)):
                    label = f"{plan.num_adapters} adapters" if spec.adapter_names else "base"
                    desc = f"{family} ({SIZES[size].key}), {label}, run {i + 1}"
                    runs[side].append(bench_serving.run_and_report(server.url, make_workload(spec),
                                                                   plan.concurrency, desc))
        results["families"][family] = {"size": SIZES[size].key, **{side: best_of(r) for side, r in runs.items()}}
    results["hybrid"] = hybrid_steps(plan, dtype)
    results["latent_kv"] = latent_kv_bytes(dtype)
    results["quantized_moe"] = quantized_moe_steps(plan, dtype, cache_dir, repeats)
    results["measured"] = measure_ratios(results)
    return results


def quantized_moe_steps(plan: Plan, dtype: str, cache_dir: Path, repeats: int) -> dict:
    """{label: {'step_ms', 'expert_mib'}} for the plain MoE bench model and its QUANTIZED_EXPERTS copies (written once
    beside it)."""
    from tests.quantize_checkpoint import write_quantized

    bench = ensure_bench_model(SIZES[plan.family_size("qwen3_moe")], plan.num_adapters, cache_dir)
    models = {"plain": bench}
    for label, fmt in QUANTIZED_EXPERTS.items():
        out_dir = bench.base_dir.with_name(f"{bench.base_dir.name}-{label.upper()}")  # as published copies are named
        build_atomically(out_dir, lambda out, fmt=fmt: write_quantized(bench.base_dir, fmt, out, None,
                                                                       EXPERTS_GROUP_SIZE))  # fmt: skip
        models[label] = replace(bench, base_dir=out_dir)
    batch = plan.num_adapters
    runners = {label: make_runner(model, dtype=dtype, batch=batch, context=plan.hybrid_context,
                                  max_loras_per_batch=batch, num_adapters=batch)
               for label, model in models.items()}  # fmt: skip
    steps: dict[str, list[float]] = {label: [] for label in runners}
    for _ in range(repeats):
        for label, (runner, pages) in runners.items():
            reqs = decode_reqs(pages, plan.hybrid_context, list(range(batch)))
            times = [step_ms(runner, reqs, step) for step in range(2 + plan.hybrid_steps)]  # 2 warm-up steps
            steps[label].append(statistics.median(times[2:]))
    rows = {}
    for label, (runner, _) in runners.items():
        experts = [m for m in runner.model.modules() if hasattr(m, "checkpoint_shards")]
        rows[label] = {"step_ms": min(steps[label]), "expert_mib": sum(m.resident_bytes for m in experts) / 2**20}
    print(f"quantized MoE experts: {rows}")
    return rows


def hybrid_steps(plan: Plan, dtype: str) -> dict:
    """{'parameters': per model, 'rows': one per batch of HYBRID_BATCHES} (hybrid_decode.measure)."""
    shapes = hybrid_decode.QUICK_SHAPES if plan.quick else hybrid_decode.SHAPES
    with tempfile.TemporaryDirectory() as tmp:
        models = hybrid_decode.write_models(Path(tmp), shapes)
        rows = hybrid_decode.measure(models, list(HYBRID_BATCHES), plan.hybrid_context, plan.hybrid_steps, dtype)
    return {"parameters": {name: n for name, (_, n) in models.items()}, "rows": rows}


def latent_kv_bytes(dtype: str) -> dict:
    """KV bytes per token of every layer on one rank: DeepSeek-V3's latent cache as the worker lays it out, and the
    same model with plain multi-head attention (keys of qk_head_dim and values of v_head_dim, every head)."""
    import torch
    from loraplex.worker.kv_cache import kv_bytes_per_token
    from loraplex.worker.model.config import ModelConfig
    from transformers import DeepseekV3Config

    hf = DeepseekV3Config()
    config = ModelConfig.from_dict(hf.to_dict())
    parts, heads, head_dim = config.kv_layout(1)
    itemsize = getattr(torch, dtype).itemsize
    latent = kv_bytes_per_token(config.num_layers, heads, head_dim, getattr(torch, dtype), parts)
    mla = config.mla
    plain = config.num_layers * config.num_heads * (mla.qk_head_dim + mla.v_head_dim) * itemsize
    return {"layers": config.num_layers, "latent": latent, "plain": plain, "dtype": dtype}


def measure_ratios(results: dict) -> dict[str, tuple[float, str]]:
    measured = {}
    for family, runs in results["families"].items():
        multi, base = (runs[side]["summary"]["output_token_throughput"] for side in ("adapters", "base"))
        measured[f"{family}_multi_vs_base"] = versus(multi, base, "out tok/s", note=f" ({runs['size']})")
    params = results["hybrid"]["parameters"]
    note = f" (median step; {params['hybrid'] / 1e6:.1f} M vs {params['dense'] / 1e6:.1f} M parameters)"
    for row in results["hybrid"]["rows"]:
        measured[f"hybrid_decode_{row['batch']}"] = versus(row["hybrid_median_ms"], row["dense_median_ms"], "ms",
                                                           digits=2, note=note)  # fmt: skip
    kv = results["latent_kv"]
    measured["latent_kv_bytes"] = versus(kv["latent"], kv["plain"], "bytes", digits=0,
                                         note=f" per token ({kv['layers']} layers, {kv['dtype']})")  # fmt: skip
    moe = results["quantized_moe"]
    for label in QUANTIZED_EXPERTS:
        measured[f"moe_{label}_expert_bytes"] = versus(moe[label]["expert_mib"], moe["plain"]["expert_mib"], "MiB")
        measured[f"moe_{label}_decode"] = versus(moe["plain"]["step_ms"], moe[label]["step_ms"], "ms", digits=2,
                                                 note=" (median step, best of the repeats)")  # fmt: skip
    return measured
