"""Ahead-of-time compilation of Triton kernels for a GPU this machine does not have (tests; no CUDA needed).

`compile_only(GPUTarget("cuda", 90, 32))` makes every Triton launch inside it compile for that target and launch
nothing: a stand-in driver answers Triton's device/stream/target questions, and Triton's jit cache hook compiles the
launch's exact specialization (the signature, constexprs and alignment attributes the real launch would get, from
the real launcher's real arguments on CPU tensors) through ptxas, then tells Triton to skip the launch. Each distinct
variant is compiled once per target and recorded.

Needs TRITON_INTERPRET unset or 0 when the kernels are imported (the interpreter wraps @triton.jit functions in
something that cannot be compiled), so the tests run it in a child process: `python tests/triton_aot.py` prints the
attention warm-up's variants and the variants of a sweep of real batches, as JSON; `python tests/triton_aot.py
model-ops` the same for the model's fused ops (RMSNorm with its residual add, rotary embedding, SiLU-and-multiply);
`gated-delta` Gated DeltaNet's conv and delta rule kernels over batches of every kind; `quant` the quantized matmuls;
`moe` the MoE experts' grouped matmul; `latent` latent attention's kernels at DeepSeek-V3's dims.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.driver import driver

# Shared memory one block may use (opt-in maximum), bytes.
SHARED_LIMIT = {80: 166912, 90: 232448}


@dataclass
class Compiled:
    kernel: str
    arch: int
    key: str  # Triton's specialization key, the same for every target
    shared_bytes: int
    compile_s: float


@dataclass
class AOTLog:
    target: GPUTarget
    compiled: dict[str, Compiled] = field(default_factory=dict)  # by key
    launches: list[str] = field(default_factory=list)  # the key of every launch made, in order


class _TargetDriver:
    """What JITFunction.run asks the active driver, answered for a device that is not here."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_device(self) -> int:
        return -int(self.target.arch)  # its own entry in each kernel's per-device cache, apart from other targets

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


@contextlib.contextmanager
def compile_only(target: GPUTarget) -> Iterator[AOTLog]:
    log = AOTLog(target)

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled) -> bool:
        key = str(key)
        log.launches.append(key)
        if key not in log.compiled:
            options = json.loads(compile["specialization_data"])["options"]
            options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
            src = ASTSource(fn.jit_function, compile["signature"], compile["constants"], compile["configs"][0])
            start = time.perf_counter()
            kernel = triton.compile(src, target=target, options=options)
            log.compiled[key] = Compiled(fn.name, int(target.arch), key, kernel.metadata.shared,
                                         time.perf_counter() - start)  # fmt: skip
        return True  # handled: Triton launches nothing

    previous_hook, previous_driver = knobs.runtime.jit_cache_hook, driver._active  # None on a machine with no GPU
    driver.set_active(_TargetDriver(target))
    knobs.runtime.jit_cache_hook = hook
    try:
        yield log
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
        driver.set_active(previous_driver)


# ---- the attention kernels: the warm-up's variants, and those of a sweep of real batches --------------------------

# (dtype, (heads, kv_heads, head_dim) per rank, page size): every dtype the server serves in on Llama-3.2-1B's shape;
# bfloat16 (the CUDA default) and float32 on Llama-3-8B's, on Qwen2-7B's with 7 query heads per KV head and pages of
# one token, and on an MHA model with head_dim 80 (padded to 128 in the kernels). A fourth field True: the model has
# attention sinks (gpt-oss's shape), whose kernel variants are the ones warmed up and served. A fifth field True: an
# FP8 KV cache (--kv-cache-dtype fp8), the KV_FP8 variants.
ATTENTION_CONFIGS = [
    ("bfloat16", (32, 8, 64), 16),
    ("float16", (32, 8, 64), 16),
    ("float32", (32, 8, 64), 16),
    ("bfloat16", (32, 8, 128), 16),
    ("float32", (32, 8, 128), 16),  # the largest tiles: shared memory is tightest here
    ("bfloat16", (28, 4, 128), 1),
    ("bfloat16", (32, 32, 80), 16),
    ("bfloat16", (64, 8, 64), 16, True),
    ("bfloat16", (32, 8, 128), 16, False, True),
    ("float32", (32, 8, 128), 16, False, True),
]
KERNELS_PER_CONFIG = 4  # decode, decode with splits, the splits' merge, extend


def _sweep_batches(num_pages: int, page_size: int) -> list:
    """Real batches of every kind the scheduler sends: decodes only (short and long, 1..40 requests, so 1 to many
    splits and page tables of every width), prefills with and without a cached prefix, and both mixed."""
    import random

    from loraplex.protocol.structs import ForwardReq, SamplingParams

    rng = random.Random(0)
    batches = []
    for num_decodes, num_extends in ((1, 0), (3, 0), (40, 0), (0, 1), (0, 3), (5, 2), (16, 1)):
        reqs = []
        for i in range(num_decodes + num_extends):
            new = 1 if i < num_decodes else rng.choice([2, 17, 64, 65, 130])
            cached = rng.choice([0, 1, 15, 16, 100, 300, 2000])
            total = cached + new
            pages = [rng.randrange(num_pages) for _ in range(-(-total // page_size))]
            reqs.append(ForwardReq(input_ids=[1] * new, num_cached_tokens=cached, page_ids=pages,
                                   sampling=SamplingParams()))  # fmt: skip
        batches.append(reqs)
    return batches


def _attention_variants(target: GPUTarget, dtype_name: str, shape: tuple[int, int, int], page_size: int,
                        sinks: bool = False, kv_fp8: bool = False) -> dict:  # fmt: skip
    import torch
    from loraplex.worker.kv_cache import FP8_DTYPE, KVCache
    from loraplex.worker.layers.attention_spec import LayerAttention
    from loraplex.worker.layers.triton_attention import TritonAttention

    heads, kv_heads, head_dim = shape
    dtype = getattr(torch, dtype_name)
    cpu = torch.device("cpu")
    num_pages = 4096 // page_size
    cache = KVCache(num_layers=1, num_pages=num_pages - 1, page_size=page_size, num_kv_heads=kv_heads,
                    head_dim=head_dim, dtype=FP8_DTYPE if kv_fp8 else dtype, device=cpu)  # fmt: skip
    kv = cache.layer(0)  # (k, v), each (num_pages * page_size, kv_heads, head_dim); an FP8 one with its scales
    backend = TritonAttention(cpu, kv_heads, sinks=sinks)
    layer = LayerAttention(scale=head_dim**-0.5, sinks=torch.zeros(heads, dtype=dtype) if sinks else None,
                           kv_scales=kv.scales.values if kv_fp8 else None)  # fmt: skip
    with compile_only(target) as log:
        backend.warmup(kv, heads, page_size, dtype=dtype)
    warmup_keys = set(log.compiled)
    with compile_only(target) as sweep:
        for reqs in _sweep_batches(num_pages, page_size):
            num_tokens = sum(len(r.input_ids) for r in reqs)
            starts = [sum(len(r.input_ids) for r in reqs[:i]) for i in range(len(reqs))]
            qkv = torch.zeros(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
            q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)  # as the model lays it out
            page_tables = torch.zeros(len(reqs), 1, dtype=torch.long)  # the SDPA backend's; unused here
            inputs = backend.build(reqs, starts, page_tables, torch.zeros(num_tokens, dtype=torch.long), page_size)
            inputs.attend(q, kv[0], kv[1], layer)
    return {
        "compiled": [vars(c) for c in log.compiled.values()],
        "warmup_keys": sorted(warmup_keys),
        "serving_keys": sorted(set(sweep.launches)),
    }


# ---- latent attention (DeepSeek-V3's 512 + 64 cache rows): the warm-up's variants, and those of real batches ---------

# (dtype, query heads per rank, page size): 128 heads at TP=1, 16 at TP=8 in bfloat16 (the CUDA default) and float16,
# float32 (the largest tiles), and pages of 64 tokens.
LATENT_CONFIGS = [
    ("bfloat16", 128, 16),
    ("bfloat16", 16, 16),
    ("float16", 16, 64),
    ("float32", 16, 16),
]
LATENT_DIMS = (512, 64)  # kv_lora_rank, qk_rope_head_dim
LATENT_KERNELS = 3  # decode, decode with splits, the splits' merge (prefills run the model's expanded form in torch)


def _latent_variants(target: GPUTarget, dtype_name: str, heads: int, page_size: int) -> dict:
    import torch
    from loraplex.worker.layers.attention import LatentTritonAttention

    latent_dim, rope_dim = LATENT_DIMS
    dtype = getattr(torch, dtype_name)
    cache = torch.zeros(4096, 1, latent_dim + rope_dim, dtype=dtype)  # keys and values: one tensor
    backend = LatentTritonAttention(torch.device("cpu"), heads, latent_dim)
    with compile_only(target) as log:
        backend.warmup((cache, cache), heads, page_size)
    warmup_keys = set(log.compiled)
    with compile_only(target) as sweep:
        for reqs in _sweep_batches(4096 // page_size, page_size):
            num_tokens = sum(len(r.input_ids) for r in reqs)
            starts = [sum(len(r.input_ids) for r in reqs[:i]) for i in range(len(reqs))]
            q = torch.zeros(num_tokens, heads, latent_dim + rope_dim, dtype=dtype)  # as the model builds it
            width = max(len(r.page_ids) for r in reqs)
            page_tables = torch.tensor([r.page_ids + [0] * (width - len(r.page_ids)) for r in reqs])  # the prefills'
            inputs = backend.build(reqs, starts, page_tables, torch.zeros(num_tokens, dtype=torch.long), page_size)
            inputs.attend(q, cache, cache)
    return {
        "compiled": [vars(c) for c in log.compiled.values()],
        "warmup_keys": sorted(warmup_keys),
        "serving_keys": sorted(set(sweep.launches)),
    }


# ---- the model's fused ops: the warm-up's variants, and those of a sweep of real batches ---------------------------

# (dtype, (hidden, intermediate, heads, kv_heads, head_dim) per rank): every dtype on Llama-3.2-1B's shape; bfloat16
# on Llama-3-8B's, on its shard at TP=8 (one KV head), and on Qwen2-7B's (7 query heads per KV head); an MHA model with
# head_dim 80 and a hidden size that is not a power of two.
MODEL_OPS_CONFIGS = [
    ("bfloat16", (2048, 8192, 32, 8, 64)),
    ("float16", (2048, 8192, 32, 8, 64)),
    ("float32", (2048, 8192, 32, 8, 64)),
    ("bfloat16", (4096, 14336, 32, 8, 128)),
    ("bfloat16", (4096, 1792, 4, 1, 128)),
    ("bfloat16", (3584, 18944, 28, 4, 128)),
    ("bfloat16", (2560, 6912, 32, 32, 80)),
]
MODEL_OPS_KERNELS = 4  # rms_norm, rms_norm with the residual add, rotary, silu_and_mul
MODEL_OPS_TOKENS = (1, 2, 7, 16, 33, 128, 1000)


def _model_ops_variants(target: GPUTarget, dtype_name: str, shape: tuple[int, int, int, int, int]) -> dict:
    import torch
    from loraplex.worker.layers.ops import TritonOps

    hidden_size, intermediate, heads, kv_heads, head_dim = shape
    dtype = getattr(torch, dtype_name)
    cpu = torch.device("cpu")
    ops = TritonOps()
    with compile_only(target) as log:
        ops.warmup(hidden_size, intermediate, heads, kv_heads, head_dim, dtype, cpu)
    warmup_keys = set(log.compiled)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    weight = torch.ones(hidden_size, dtype=dtype)
    table = torch.zeros(4096, head_dim)  # the model's float32 tables, as long as the context
    with compile_only(target) as sweep:
        for num_tokens in MODEL_OPS_TOKENS:  # each op as the model calls it, on tensors laid out as the model's
            hidden, residual = (torch.zeros(num_tokens, hidden_size, dtype=dtype) for _ in range(2))
            ops.rms_norm(hidden, weight, 1e-5)
            ops.add_rms_norm(hidden, residual, weight, 1e-5)
            qkv = torch.zeros(num_tokens, q_size + 2 * kv_size, dtype=dtype)
            q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
            positions = torch.arange(num_tokens, dtype=torch.long)
            ops.rotary_embedding(positions, q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim),
                                 table, table)  # fmt: skip
            ops.silu_and_mul(torch.zeros(num_tokens, 2 * intermediate, dtype=dtype))
    return {
        "compiled": [vars(c) for c in log.compiled.values()],
        "warmup_keys": sorted(warmup_keys),
        "serving_keys": sorted(set(sweep.launches)),
    }


# ---- the quantized linears' matmuls (kernels/quant_matmul.py), through the worker's CUDA layouts --------------------

# (out, in) of each linear: a Llama-3-8B layer (qkv and gate_up fused, as the worker stacks them) and the bench
# model's (scripts/bench/model.py "full": hidden 1024, 16 heads / 4 KV heads of 64, intermediate 2816).
QUANT_SHAPES = {
    "llama-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "bench": {"qkv": (1536, 1024), "o": (1024, 1024), "gate_up": (5632, 1024), "down": (1024, 2816)},
}
# weight form -> (kind, bits, group size or scale block; None: one group per row / one scale per tensor)
QUANT_FORMS = {
    "int4-g32": ("int", 4, 32), "int4-g64": ("int", 4, 64), "int4-g128": ("int", 4, 128),
    "int8-channel": ("int", 8, None), "int8-g128": ("int", 8, 128),
    "fp8-block128": ("fp8", 8, 128), "fp8-tensor": ("fp8", 8, None), "fp8-channel": ("fp8", 8, 1),
}  # fmt: skip
QUANT_DTYPES = ("bfloat16", "float16")
QUANT_TOKENS = (1, 32, 1000)  # decode batch 1, a decode batch of 32, a prefill (not a multiple of 16)
QUANT_KERNELS = {"int": "_int_matmul_kernel", "fp8": "_fp8_matmul_kernel"}


def _quant_layout(form: str, num_rows: int, num_cols: int):
    """The worker's CUDA layout (worker/quant/matmul.py) of a zero weight in `form`, built on the CPU."""
    import torch
    from loraplex.worker.quant.matmul import TritonFP8Matmul, TritonIntMatmul
    from loraplex.worker.quant.weights import FloatWeight, IntWeight

    kind, bits, group = QUANT_FORMS[form]
    if kind == "int":  # GPTQ's form: unsigned values with zero points
        group_size = group or num_cols
        num_groups = num_cols // group_size
        weight = IntWeight(q=torch.zeros(num_rows, num_cols, dtype=torch.uint8),
                           scales=torch.ones(num_rows, num_groups),
                           zeros=torch.zeros(num_rows, num_groups, dtype=torch.int32), g_idx=None,
                           group_size=group_size, bits=bits)  # fmt: skip
        return TritonIntMatmul(weight, torch.bfloat16)
    q = torch.zeros(num_rows, num_cols, dtype=torch.float8_e4m3fn)
    block_rows, block_cols = {128: (128, 128), None: (num_rows, num_cols), 1: (1, num_cols)}[group]
    scales = torch.ones(-(-num_rows // block_rows), -(-num_cols // block_cols))
    return TritonFP8Matmul(FloatWeight.blocked(q, scales, block_rows, block_cols), torch.bfloat16)


def _quant_variants(target: GPUTarget, model: str) -> list[dict]:
    import torch

    results = []
    for form, (kind, _, _) in QUANT_FORMS.items():
        layouts = [(_quant_layout(form, *shape), shape[1]) for shape in QUANT_SHAPES[model].values()]
        for dtype_name in QUANT_DTYPES:
            dtype = getattr(torch, dtype_name)
            with compile_only(target) as log:
                for matmul, num_cols in layouts:
                    for num_tokens in QUANT_TOKENS:
                        matmul(torch.zeros(num_tokens, num_cols, dtype=dtype))
            results.append({"arch": int(target.arch), "model": model, "form": form, "dtype": dtype_name,
                            "kernel": QUANT_KERNELS[kind], "launches": len(log.launches),
                            "compiled": [vars(c) for c in log.compiled.values()]})  # fmt: skip
    return results


# ---- the MoE experts' grouped matmul (kernels/moe_matmul.py), on device routing -------------------------------------

# (dtype, MXFP4, (experts, hidden, intermediate) per rank, bias): gpt-oss-20b's experts (MXFP4, with biases) and
# Mixtral-8x7B's at TP=2 (plain, no bias) in bfloat16, and in float32 (the largest tiles).
MOE_CONFIGS = [
    ("bfloat16", True, (32, 2880, 2880), True),
    ("bfloat16", False, (8, 4096, 7168), False),
    ("float32", False, (8, 4096, 7168), False),
]
MOE_TOKENS = (1, 7, 64, 300, 2048)  # decode batches and prefills, top-4 (gpt-oss) or top-2 rows each


def _moe_variants(target: GPUTarget, dtype_name: str, mxfp4: bool, shape: tuple[int, int, int], bias: bool) -> dict:
    """The start-up warm-up's variants (warm_up_device_routing) and those of a sweep of real batches, for the block's
    gate_up and down linears."""
    import torch
    from loraplex.worker.layers.moe import MoEExperts, Routing, warm_up_device_routing
    from loraplex.worker.quant.layer import quantized_linears
    from loraplex.worker.quant.mxfp4 import Mxfp4Format

    dtype = getattr(torch, dtype_name)
    num_experts, hidden, intermediate = shape
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with quantized_linears(Mxfp4Format({}) if mxfp4 else None), torch.device("meta"):
            experts = MoEExperts(num_experts, hidden, intermediate, bias=bias)
    finally:
        torch.set_default_dtype(previous)
    experts = experts.to_empty(device="cpu")
    with compile_only(target) as log:
        warm_up_device_routing(experts)
    warmup_keys = set(log.compiled)
    top_k = 4 if mxfp4 else 2
    with compile_only(target) as sweep:
        for num_tokens in MOE_TOKENS:
            ids = torch.arange(num_tokens * top_k).view(num_tokens, top_k) % num_experts
            routing = Routing.build(ids, torch.ones(ids.shape), num_experts, on_device=True)
            gate_up = experts.gate_up_proj(torch.zeros(num_tokens * top_k, hidden, dtype=dtype), routing)
            experts.down_proj(gate_up[:, :intermediate].contiguous(), routing)
    return {"compiled": [vars(c) for c in log.compiled.values()], "warmup_keys": sorted(warmup_keys),
            "serving_keys": sorted(set(sweep.launches)), "launches": sweep.launches}  # fmt: skip


# ---- Gated DeltaNet's kernels (kernels/gated_delta.py), launched by the layer's Triton mixer -------------------------

# (dtype, state dtype, (key_heads, value_heads, dk, dv, conv kernel) per rank): the linear attention of
# Qwen3-Next-80B-A3B, Qwen3.5-27B and Qwen3.5-35B-A3B (one shape: transformers' config defaults) in every activation
# dtype, its state in float32 too (--mamba-ssm-cache-dtype float32), and its shard at TP=4.
GATED_DELTA_CONFIGS = [
    ("bfloat16", "bfloat16", (16, 32, 128, 128, 4)),
    ("bfloat16", "float32", (16, 32, 128, 128, 4)),
    ("float16", "float16", (16, 32, 128, 128, 4)),
    ("float32", "float32", (16, 32, 128, 128, 4)),
    ("bfloat16", "bfloat16", (4, 8, 128, 128, 4)),
]
GATED_DELTA_KERNELS = 4  # the conv and the delta rule, each varlen and one-token
# new tokens per request: decodes only (the one-token launches), then mixed batches and one long prompt (varlen)
GATED_DELTA_BATCHES = ([1], [1] * 40, [5, 1, 300], [1] * 7 + [17, 64], [2000])


def _gated_delta_variants(target: GPUTarget, dtype_name: str, state_dtype_name: str,
                          shape: tuple[int, int, int, int, int]) -> dict:  # fmt: skip
    import torch
    from loraplex.worker.layers.delta_mixer import TritonDeltaMixer
    from loraplex.worker.state_cache import StateBatch

    key_heads, value_heads, dk, dv, kernel = shape
    dtype, state_dtype = getattr(torch, dtype_name), getattr(torch, state_dtype_name)
    cpu = torch.device("cpu")
    num_slots, channels = 48, 2 * key_heads * dk + value_heads * dv
    conv_states = torch.zeros(num_slots, channels, kernel - 1, dtype=state_dtype)
    states = torch.zeros(num_slots, value_heads, dk, dv, dtype=state_dtype)
    weight = torch.zeros(channels, 1, kernel, dtype=dtype)[:, 0]  # as the layer slices conv1d.weight
    mixer = TritonDeltaMixer()
    with compile_only(target) as log:
        mixer.warmup(conv_states, states, weight, key_heads)
    warmup_keys = set(log.compiled)
    with compile_only(target) as sweep:
        for num_new in GATED_DELTA_BATCHES:
            num_tokens = sum(num_new)
            batch = StateBatch.of(list(range(len(num_new))), num_new, cpu)
            mixed = torch.zeros(num_tokens, channels, dtype=dtype)
            q, k, v = mixer.conv(mixed, conv_states, weight, batch).split([key_heads * dk] * 2 + [value_heads * dv], -1)
            g = torch.zeros(num_tokens, value_heads)
            beta = torch.zeros(num_tokens, value_heads, dtype=dtype)
            mixer.rule(q.view(num_tokens, key_heads, dk), k.view(num_tokens, key_heads, dk),
                       v.view(num_tokens, value_heads, dv), g, beta, states, batch)  # fmt: skip
    return {"compiled": [vars(c) for c in log.compiled.values()], "warmup_keys": sorted(warmup_keys),
            "serving_keys": sorted(set(sweep.launches)), "launches": sweep.launches}  # fmt: skip


def main() -> None:
    results = []
    for arch in (90, 80):
        target = GPUTarget("cuda", arch, 32)
        if sys.argv[1:] == ["quant"]:
            for model in QUANT_SHAPES:
                results += _quant_variants(target, model)
            continue
        if sys.argv[1:] == ["moe"]:
            for dtype_name, mxfp4, shape, bias in MOE_CONFIGS:
                found = _moe_variants(target, dtype_name, mxfp4, shape, bias)
                results.append({"arch": arch, "dtype": dtype_name, "mxfp4": mxfp4, "shape": shape, **found})
            continue
        if sys.argv[1:] == ["latent"]:
            for dtype_name, heads, page_size in LATENT_CONFIGS:
                found = _latent_variants(target, dtype_name, heads, page_size)
                results.append({"arch": arch, "dtype": dtype_name, "heads": heads, "page_size": page_size, **found})
            continue
        if sys.argv[1:] == ["gated-delta"]:
            for dtype_name, state_dtype_name, shape in GATED_DELTA_CONFIGS:
                found = _gated_delta_variants(target, dtype_name, state_dtype_name, shape)
                results.append({"arch": arch, "dtype": dtype_name, "state_dtype": state_dtype_name, "shape": shape,
                                **found})  # fmt: skip
            continue
        if sys.argv[1:] == ["model-ops"]:
            for dtype_name, shape in MODEL_OPS_CONFIGS:
                found = _model_ops_variants(target, dtype_name, shape)
                results.append({"arch": arch, "dtype": dtype_name, "shape": shape, **found})
            continue
        for dtype_name, shape, page_size, *sinks in ATTENTION_CONFIGS:
            found = _attention_variants(target, dtype_name, shape, page_size, *sinks)
            results.append({"arch": arch, "dtype": dtype_name, "shape": shape, "page_size": page_size, **found})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
