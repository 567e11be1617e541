"""Groups G0 (environment and ceilings), G2 (paged attention against an fp32 reference) and G3 (model numerics
against HF/peft) of scripts/gpu_check/runner.py."""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import os
import platform
import random
import subprocess
import tempfile
from pathlib import Path

from scripts.gpu_check.latent import latent_attention
from scripts.gpu_check.lib import Context, max_abs, median, time_ms

# ---- G0: environment ---------------------------------------------------------------------------------------------


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # recorded, not raised: a missing package is the finding
        return f"missing ({type(e).__name__})"
    return getattr(mod, "__version__", None) or getattr(mod, "pyzmq_version", lambda: None)()


def _xgrammar_import() -> tuple[str, str]:
    """(version, "" or why it does not import): G5b's structured output needs the import, not only the package (its
    dependencies come as wheels of their own, scripts/gpu_check/gpu_wheels.txt)."""
    try:
        version = importlib.metadata.version("xgrammar")
    except importlib.metadata.PackageNotFoundError:
        return "missing", "not installed"
    try:
        importlib.import_module("xgrammar")
    except Exception as e:  # recorded, not raised: which module is missing is the finding
        return version, f"{type(e).__name__}: {e}"
    return version, ""


def g0_env(ctx: Context) -> None:
    import torch

    rec = ctx.rec
    interpret = os.environ.get("TRITON_INTERPRET", "")
    truthy = interpret.lower() not in ("", "0", "false", "no")
    if ctx.dry_run:
        rec.check("triton_interpret", truthy, interpret, "1 on a CPU dry run", "the kernels run in the interpreter")
    else:
        rec.check("triton_interpret_off", not truthy, interpret or "unset", "0 or unset",
                  "CUDA tensors through the interpreter are slow and wrong in bf16")
    failed = []
    for module in ("loraplex.protocol.structs", "loraplex.protocol.config", "loraplex.protocol.sockets",
                   "loraplex.worker.model_runner", "loraplex.worker.dist", "loraplex.worker.lora.manager",
                   "loraplex.frontend.entrypoints.engine"):
        try:
            importlib.import_module(module)
        except Exception as e:
            failed.append(f"{module}: {type(e).__name__}: {e}")
    rec.check("imports", not failed, failed or "all", "worker.*, protocol.*, frontend.entrypoints.engine import")
    xgrammar_version, xgrammar_error = _xgrammar_import()
    rec.check("xgrammar_import", not xgrammar_error, xgrammar_error or "ok", "imports",
              "structured output (G5b) needs it: without it the server answers 501")
    versions = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                **{m: _version(m) for m in ("triton", "transformers", "peft", "msgspec", "zmq", "safetensors")},
                "xgrammar": xgrammar_version + (f" (import fails: {xgrammar_error})" if xgrammar_error else "")}
    sdp = {}
    if ctx.is_cuda:
        rec.check("cuda_available", torch.cuda.is_available(), torch.cuda.is_available(), True)
        versions["cudnn"] = torch.backends.cudnn.version()
        nccl = torch.cuda.nccl.version()
        versions["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        device = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                  "sm_count": props.multi_processor_count, "total_GiB": total / 2**30, "free_GiB": free / 2**30,
                  "driver": _driver()}
        sdp = {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")()
               for name in ("flash", "mem_efficient", "cudnn", "math")}
        sdp["matmul_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    else:
        rec.skip("cuda_available", "dry-run: needs CUDA")
        device = {"name": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"}
    rec.figure("versions", versions)
    rec.figure("device", device)
    rec.figure("sdp", sdp)
    rec.figure("env", {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")})
    ceilings = _ceilings(ctx)
    rec.figure("ceilings", ceilings)
    rec.check("ceilings_measured", all(v is None or v > 0 for v in ceilings.values()), ceilings, "> 0")


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _ceilings(ctx: Context) -> dict:
    import torch

    dev = ctx.device
    reps, warm = ctx.reps(), ctx.warmups()
    n_bytes = 2**31 if ctx.is_cuda else 2**26
    src = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = median(time_ms(lambda: dst.copy_(src), dev, reps=reps, warmups=warm))
    src = dst = None  # freed before the GEMM buffers
    size, dtype = (8192, torch.bfloat16) if ctx.is_cuda else (512, torch.float32)
    a = torch.randn(size, size, device=dev, dtype=dtype)
    b = torch.randn(size, size, device=dev, dtype=dtype)
    gemm_ms = median(time_ms(lambda: a @ b, dev, reps=reps, warmups=warm))
    a = b = None
    h2d = None
    if ctx.is_cuda:
        host = torch.empty(2**28, dtype=torch.uint8).pin_memory()
        dev_buf = torch.empty(2**28, dtype=torch.uint8, device=dev)
        h2d_ms = median(time_ms(lambda: dev_buf.copy_(host, non_blocking=True), dev, reps=reps, warmups=warm))
        h2d = 2**28 / h2d_ms / 1e6
    return {"copy_GBps": 2 * n_bytes / copy_ms / 1e6, "bf16_gemm_TFLOPs": 2 * size**3 / gemm_ms / 1e9,
            "h2d_pinned_GBps": h2d}


# ---- G2: attention -----------------------------------------------------------------------------------------------


class AttnSetup:
    """A random cache of shuffled pages, and batches of fake requests driven through BatchInputs + paged_attention,
    with one attention backend: `torch` (SDPA over gathered pages) or `triton` (the paged kernels)."""

    def __init__(self, ctx: Context, dtype, attention: str = "torch"):
        import torch
        from loraplex.worker.layers.attention import select_attention_backend

        self.dev, self.dtype = ctx.device, dtype
        self.page_size = 16
        self.num_pages = 4096 if ctx.is_cuda else 256
        self.heads, self.kv_heads, self.head_dim = (32, 8, 64) if ctx.is_cuda else (4, 2, 16)
        self.gen = torch.Generator(device=self.dev).manual_seed(0)
        slots = self.num_pages * self.page_size
        self.k_cache = self.randn(slots, self.kv_heads, self.head_dim)
        self.v_cache = self.randn(slots, self.kv_heads, self.head_dim)
        self.free_pages = list(range(self.num_pages))
        random.Random(0).shuffle(self.free_pages)
        self.attention = select_attention_backend(attention, self.dev, self.heads, self.kv_heads, self.head_dim)

    def randn(self, *size):
        import torch

        return torch.randn(size, generator=self.gen, device=self.dev, dtype=torch.float32).to(self.dtype)

    def batch(self, spec: list[tuple[int, int]]):
        """spec: (cached, new) per request -> (reqs, inputs, q, k, v)."""
        from loraplex.protocol.structs import ForwardReq, SamplingParams
        from loraplex.worker.batch_inputs import BatchInputs

        pages = itertools.cycle(self.free_pages)  # only timing batches outgrow the cache; they may share pages
        reqs = []
        for cached, new in spec:
            num = -(-(cached + new) // self.page_size)
            reqs.append(ForwardReq(input_ids=[0] * new, num_cached_tokens=cached,
                                   page_ids=list(itertools.islice(pages, num)), sampling=SamplingParams()))
        inputs = BatchInputs.build(reqs, self.page_size, self.num_pages, 1 << 20, self.dev, self.attention)
        tokens = sum(new for _, new in spec)
        q = self.randn(tokens, self.heads, self.head_dim)
        return reqs, inputs, q, self.randn(tokens, self.kv_heads, self.head_dim), self.randn(
            tokens, self.kv_heads, self.head_dim)

    def run(self, inputs, q, k, v, chunk: int | None = None):
        from loraplex.worker.layers.attention import paged_attention
        from loraplex.worker.layers.attention_spec import LayerAttention

        layer = LayerAttention(scale=self.head_dim**-0.5, chunk_size=chunk)
        return paged_attention(q, k, v, self.k_cache, self.v_cache, inputs.attention, layer)

    def reference(self, reqs, q, chunk: int | None = None):
        """fp32 softmax(QKᵀ/√d + causal)V per request, straight from the pages (call after run: the cache holds the
        new K/V); with a chunk, each query sees only its chunk's keys (Llama 4's chunked local attention)."""
        import torch

        outs, row = [], 0
        group = self.heads // self.kv_heads
        for req in reqs:
            new, cached = len(req.input_ids), req.num_cached_tokens
            pos = torch.arange(cached + new, device=self.dev)
            page_ids = torch.tensor(req.page_ids, device=self.dev)
            slots = page_ids[pos // self.page_size] * self.page_size + pos % self.page_size
            keys = self.k_cache[slots].float().repeat_interleave(group, dim=1)  # (kv_len, heads, d)
            values = self.v_cache[slots].float().repeat_interleave(group, dim=1)
            qs = q[row : row + new].float()  # (new, heads, d)
            row += new
            scores = torch.einsum("qhd,khd->hqk", qs, keys) * self.head_dim**-0.5
            q_pos = (cached + torch.arange(new, device=self.dev))[:, None]  # (new, 1)
            causal = pos[None, :] <= q_pos  # (new, kv_len)
            if chunk is not None:
                causal &= pos[None, :] // chunk == q_pos // chunk
            scores = scores.masked_fill(~causal, float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        return torch.cat(outs)


def _attn_specs(ctx: Context) -> dict[str, list[tuple[int, int]]]:
    if ctx.is_cuda:
        lengths, prefill = (1, 16, 17, 64, 129, 500, 1000, 2047), [(0, 7), (5, 300), (100, 513), (0, 1)]
    else:
        lengths, prefill = (1, 16, 17, 40, 70), [(0, 7), (5, 30), (10, 51), (0, 1)]
    decode = [(n - 1, 1) for n in lengths for _ in range(4)]
    # Few requests with long contexts: the triton backend splits their keys (decode_num_splits: 8 and 16 on CUDA, 4
    # and 16 at the dry run's sizes) and merges the splits; a 1-key request among them leaves most of its splits empty.
    long_lengths = (8192, 3001, 700, 1) if ctx.is_cuda else (1101, 600, 1)
    longest = 8192 if ctx.is_cuda else 4096
    return {"decode": decode, "prefill": prefill, "mixed": decode + prefill,
            "long_decode": [(n - 1, 1) for n in long_lengths], "long_decode_one": [(longest - 1, 1)]}


def _attn_error(setup: AttnSetup, spec, chunk: int | None = None) -> tuple[float, bool, object]:
    """(max abs error against the fp32 reference, all finite, the batch's attention inputs)."""
    import torch

    reqs, inputs, q, k, v = setup.batch(spec)
    out = setup.run(inputs, q, k, v, chunk)
    return max_abs(out.float(), setup.reference(reqs, q, chunk)), bool(torch.isfinite(out).all()), inputs.attention


def _classify(names: list[str]) -> str:
    lowered = " ".join(names).lower()
    kinds = (("cudnn", ("cudnn",)), ("flash", ("flash",)), ("efficient", ("fmha", "efficient", "cutlass")))
    for backend, keys in kinds:
        if any(key in lowered for key in keys):
            return backend
    return "math"


def _backend_used(setup: AttnSetup, spec) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    _, inputs, q, k, v = setup.batch(spec)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        setup.run(inputs, q, k, v)
        torch.cuda.synchronize()
    return _classify([e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA])


def g2_attention(ctx: Context) -> None:
    import torch

    rec = ctx.rec
    specs = _attn_specs(ctx)
    worst = 0.0
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5)):
        setup = AttnSetup(ctx, dtype)
        for name, spec in specs.items():
            err, finite, _ = _attn_error(setup, spec)
            rec.check(f"{name}.{str(dtype)[6:]}", finite and err <= tol, err, tol,
                      "" if finite else "NaN/Inf in the output")
            if dtype == torch.bfloat16:
                worst = max(worst, err)
    rec.figure("max_err", worst)
    # The paged Triton kernels (--attention-backend triton, the CUDA default): the same batches and reference. In a
    # dry run they run in Triton's interpreter, whose bfloat16 dots are wrong: float16 stands in for it there.
    triton_worst, splits = 0.0, {}
    low = (torch.bfloat16, 2e-2) if ctx.is_cuda else (torch.float16, 5e-3)
    for dtype, tol in (low, (torch.float32, 1e-5)):
        setup = AttnSetup(ctx, dtype, "triton")
        for name, spec in specs.items():
            err, finite, attention = _attn_error(setup, spec)
            rec.check(f"triton.{name}.{str(dtype)[6:]}", finite and err <= tol, err, tol,
                      "" if finite else "NaN/Inf in the output")
            if dtype != torch.float32:
                triton_worst = max(triton_worst, err)
            if name.startswith("long_decode"):  # the group exists to test the split path: it must take it
                splits[name] = attention.decode.num_splits
                rec.check(f"triton.{name}.{str(dtype)[6:]}.splits", splits[name] > 1, splits[name], "> 1",
                          "key splits of the decode kernel, merged by the merge kernel")
        # Llama 4's chunked local attention: a mixed batch (one decode of each length, the prefills), each query
        # seeing only its chunk's keys (chunks across pages and key blocks; several per long request)
        chunked = specs["decode"][::4] + specs["prefill"]
        err, finite, _ = _attn_error(setup, chunked, chunk=192 if ctx.is_cuda else 24)
        rec.check(f"triton.chunked_mixed.{str(dtype)[6:]}", finite and err <= tol, err, tol,
                  "" if finite else "NaN/Inf in the output")
    rec.figure("triton_max_err", triton_worst)
    rec.figure("triton_decode_splits", splits)
    latent_attention(ctx)  # the triton backend's latent kernels (DeepSeek-V3), scripts/gpu_check/latent.py
    if not ctx.skip_unless_cuda("backend_probe"):
        for name in ("backends", "decode_timing", "prefill_8k_memory"):
            ctx.rec.skip(name, "dry-run: needs CUDA")
        return
    setup = AttnSetup(ctx, torch.bfloat16)
    rec.figure("backend", {"decode": _backend_used(setup, specs["decode"]),
                           "prefill": _backend_used(setup, specs["prefill"])})
    _probe_backends(ctx, setup, specs["mixed"])
    _decode_timing(ctx, setup, AttnSetup(ctx, torch.bfloat16, "triton"))
    _prefill_memory(ctx, setup, "")
    _prefill_memory(ctx, AttnSetup(ctx, torch.bfloat16, "triton"), "triton_")


def _probe_backends(ctx: Context, setup: AttnSetup, spec) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    accepting, results = [], {}
    for backend in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "MATH"):
        try:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                err, finite, _ = _attn_error(setup, spec)
        except RuntimeError as e:
            results[backend] = {"accepts": False, "why": str(e)[:160]}
            continue
        accepting.append(backend)
        results[backend] = {"accepts": True, "max_err": err}
        ctx.rec.check(f"backend.{backend}", finite and err <= 2e-2, err, 2e-2,
                      "accepts the call: a wrong result is silent corruption if torch ever picks it")
    ctx.rec.figure("backends", results)
    ctx.rec.figure("backends_accepting", ",".join(accepting) or "none")


def _decode_timing(ctx: Context, setup: AttnSetup, paged: AttnSetup) -> None:
    import torch.nn.functional as F
    from loraplex.worker.layers.attention import _gather_pages

    copy_gbps = ctx.ceilings.get("copy_GBps") or float("nan")
    table = {}
    for batch in (32, 128):
        for context in (512, 2048):
            _, inputs, q, k, v = setup.batch([(context - 1, 1)] * batch)
            attend_us = median(time_ms(lambda a=(inputs, q, k, v): setup.run(*a), setup.dev, reps=20, warmups=3)) * 1e3
            group = inputs.attention.groups[0]
            keys = _gather_pages(setup.k_cache, group.read_pages, group.page_size)
            values = _gather_pages(setup.v_cache, group.read_pages, group.page_size)
            q4 = q.view(batch, 1, setup.heads, setup.head_dim).transpose(1, 2)

            def sdpa(q4=q4, keys=keys, values=values, mask=group.mask):
                return F.scaled_dot_product_attention(q4, keys, values, attn_mask=mask, enable_gqa=True)

            sdpa_us = median(time_ms(sdpa, setup.dev, reps=20, warmups=3)) * 1e3
            _, paged_inputs, q, k, v = paged.batch([(context - 1, 1)] * batch)
            triton_us = median(time_ms(lambda a=(paged_inputs, q, k, v): paged.run(*a), setup.dev, reps=20,
                                       warmups=3)) * 1e3  # fmt: skip
            kv_roofline_us = 2 * batch * context * setup.kv_heads * setup.head_dim * 2 / copy_gbps / 1e3
            table[f"B{batch}_ctx{context}"] = {"us": attend_us, "sdpa_pregathered_us": sdpa_us,
                                               "x_kv_roofline": attend_us / kv_roofline_us,
                                               "gather_share": 1 - sdpa_us / attend_us,
                                               "triton_us": triton_us,
                                               "triton_x_kv_roofline": triton_us / kv_roofline_us}
    ctx.rec.figure("decode_timing", table)


def _prefill_memory(ctx: Context, setup: AttnSetup, prefix: str) -> None:
    import torch

    _, inputs, q, k, v = setup.batch([(0, 8192)])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    setup.run(inputs, q, k, v)
    torch.cuda.synchronize()
    delta_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
    ctx.rec.figure(f"{prefix}prefill_8k_mem_GiB", delta_gib)
    ctx.rec.flag(f"{prefix.upper()}ATTN_8K_MEMORY", delta_gib > 2, delta_gib, 2,
                 "GiB for one 8192-token prefill group (math fallback?)")


# ---- G3: model numerics ------------------------------------------------------------------------------------------

PROMPT_LENGTHS = [5, 9, 3, 17, 8, 12]
ADAPTERS = [None, "a4", "a8", "a16", "a32", "a64"]


def _runner(ctx: Context, model_dir: Path, dtype: str, lora: bool = True):
    from loraplex.protocol.config import ServerConfig
    from loraplex.worker.model_runner import ModelRunner

    lora_kwargs = dict(enable_lora=True, max_lora_rank=64, lora_target_modules=["all"], max_loras_per_batch=6)
    config = ServerConfig(device=ctx.device.type, dtype=dtype, page_size=4, max_total_tokens=4096,
                          lora_backend=ctx.lora_backend, **(lora_kwargs if lora else {}))
    return ModelRunner(config, str(model_dir), 0, 1, ctx.device.type)


def _build_models(ctx: Context, root: Path) -> dict[str, Path]:
    from tests.builders import build_tiny_model

    models = {"llama": root / "llama", "qwen2": root / "qwen2"}
    build_tiny_model(models["llama"], arch="llama")
    build_tiny_model(models["qwen2"], arch="qwen2", tie_word_embeddings=False)
    if ctx.is_cuda:
        models["medium"] = root / "medium"
        build_tiny_model(models["medium"], hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2,
                         intermediate_size=1376, max_position_embeddings=2048)
    return models


def _build_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    from tests.adapter_specs import ADAPTER_SPECS
    from tests.builders import build_lora_adapter

    paths = {}
    for seed, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTER_SPECS.items(), start=1):
        paths[name] = root / name
        build_lora_adapter(model_dir, paths[name], r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                           seed=seed)
    return paths


def _load_adapters(runner, adapters: dict[str, Path]) -> dict[str, int]:
    from loraplex.protocol.structs import AdapterToLoad

    ids = {name: i + 1 for i, name in enumerate(adapters)}
    specs = [AdapterToLoad(lora_id=ids[n], lora_name=n, lora_path=str(p)) for n, p in adapters.items()]
    outcomes = runner.lora.load(specs)
    failed = [o.error_message for o in outcomes if not o.success]
    if failed:
        raise RuntimeError(f"adapter load failed: {failed}")
    return ids


def _prefill_and_step(runner, prompts, slots, ids_by_slot, steps_pages: int = 8):
    """Prefill the prompts in one batch (slots loaded with it), then one decode step with each request's greedy
    token; (per-request prefill logits, step logits (reqs, vocab), the tokens fed)."""
    from loraplex.protocol.structs import ForwardBatch, ForwardReq, SamplingParams, SlotLoad

    from tests.worker_helpers import forward_logits

    greedy = SamplingParams(temperature=0.0)
    pages, next_page = [], 0
    for p in prompts:
        n = -(-(len(p) + steps_pages) // runner.page_size)
        pages.append(list(range(next_page, next_page + n)))
        next_page += n
    loads = [SlotLoad(slot=s, lora_id=ids_by_slot[s]) for s in sorted(set(slots)) if s >= 0]
    reqs = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=greedy, slot=s)
            for p, pg, s in zip(prompts, pages, slots, strict=True)]
    prefill = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=loads)).float().cpu()
    per_req = list(prefill.split([len(p) for p in prompts]))
    tokens = [int(lg[-1].argmax()) for lg in per_req]
    step_reqs = [ForwardReq(input_ids=[t], num_cached_tokens=len(p), page_ids=pg, sampling=greedy, slot=s)
                 for t, p, pg, s in zip(tokens, prompts, pages, slots, strict=True)]
    step = forward_logits(runner, ForwardBatch(batch_id=1, reqs=step_reqs)).float().cpu()
    return per_req, step, tokens


def _hf_logits(model, ids: list[int], device=None):
    import torch

    with torch.inference_mode():
        return model(torch.tensor([ids], device=device)).logits[0].float().cpu()


def _hf_bf16(model_dir: Path, adapter_dir: Path | None, device):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    return model.to(device).eval()


def g3_numerics(ctx: Context) -> None:
    from tests.reference import hf_model
    from tests.worker_helpers import prefill_logits, random_prompts

    rec = ctx.rec
    root = Path(tempfile.mkdtemp(prefix="gpu_check_g3_"))
    models = _build_models(ctx, root)
    if ctx.dry_run:
        rec.skip("N1.medium", "dry-run: tiny models only")
    worst_fp32, worst_ours, worst_hf = 0.0, 0.0, 0.0
    for name, model_dir in models.items():
        prompts = random_prompts([16] * 4, 1000, seed=1)
        hf32 = [_hf_logits(hf_model(str(model_dir)), p) for p in prompts]
        runner = _runner(ctx, model_dir, "float32", lora=False)
        ours32 = [prefill_logits(runner, p).float().cpu() for p in prompts]
        err = max(max_abs(a, b) for a, b in zip(ours32, hf32, strict=True))
        worst_fp32 = max(worst_fp32, err)
        rec.check(f"N1.{name}.fp32_vs_hf", err <= 2e-4, err, 2e-4)
        del runner
        runner = _runner(ctx, model_dir, "bfloat16", lora=False)
        ours16 = [prefill_logits(runner, p).float().cpu() for p in prompts]
        del runner
        hf_bf16 = _hf_bf16(model_dir, None, ctx.device)
        hf16 = [_hf_logits(hf_bf16, p, ctx.device) for p in prompts]
        del hf_bf16
        _calibrated(rec, f"N2.{name}.bf16", ours16, hf16, hf32)
        worst_ours = max(worst_ours, max(max_abs(a, b) for a, b in zip(ours16, hf32, strict=True)))
        worst_hf = max(worst_hf, max(max_abs(a, b) for a, b in zip(hf16, hf32, strict=True)))
    rec.figure("fp32_vs_hf", worst_fp32)
    rec.figure("bf16_ours", worst_ours)
    rec.figure("bf16_hf", worst_hf)
    lora_models = {k: v for k, v in models.items() if k in ("llama", "medium")}
    matched = total = 0
    for name, model_dir in lora_models.items():
        adapters = _build_adapters(model_dir, root / f"{name}_adapters")
        m, t = _lora_numerics(ctx, name, model_dir, adapters)
        matched, total = matched + m, total + t
    rec.figure("greedy_matched", matched)
    rec.figure("greedy_total", total)


def _calibrated(rec, name: str, ours, hf_low, hf_ref) -> None:
    """bf16 passes when its error against fp32 HF is within 1.5x HF's own bf16 error + 0.02, and its argmax agrees
    with fp32 HF at least as often as HF bf16 does, less 1 % or one position (whichever is more: with ~50
    positions, 1 % is finer than one token)."""
    import torch

    e_ours = max(max_abs(a, b) for a, b in zip(ours, hf_ref, strict=True))
    e_hf = max(max_abs(a, b) for a, b in zip(hf_low, hf_ref, strict=True))
    ref_top = torch.cat([r.argmax(-1) for r in hf_ref])
    agree_ours = float((torch.cat([o.argmax(-1) for o in ours]) == ref_top).float().mean())
    agree_hf = float((torch.cat([h.argmax(-1) for h in hf_low]) == ref_top).float().mean())
    slack = max(0.01, 1 / len(ref_top))
    ok = e_ours <= 1.5 * e_hf + 0.02 and agree_ours >= agree_hf - slack - 1e-9
    rec.check(name, ok, {"e_ours": e_ours, "e_hf": e_hf, "agree_ours": agree_ours, "agree_hf": agree_hf},
              "e_ours <= 1.5 e_hf + 0.02; agree >= hf - max(1%, 1 position)")


def _lora_numerics(ctx: Context, name: str, model_dir: Path, adapters: dict[str, Path]) -> tuple[int, int]:
    import torch
    from loraplex.protocol.structs import SamplingParams

    from tests.reference import CLEAR_MARGIN, hf_greedy, hf_model
    from tests.worker_helpers import GREEDY, decode, random_prompts

    rec = ctx.rec
    prompts = random_prompts(PROMPT_LENGTHS, 1000, seed=2)
    runner = _runner(ctx, model_dir, "float32")
    ids = _load_adapters(runner, adapters)
    slots = [-1 if a is None else i for i, a in enumerate(ADAPTERS)]  # sorted by slot, as the scheduler sends them
    ids_by_slot = {i: ids[a] for i, a in enumerate(ADAPTERS) if a}

    def peft(adapter):
        return hf_model(str(model_dir), None if adapter is None else str(adapters[adapter]))

    per_req, step, tokens = _prefill_and_step(runner, prompts, slots, ids_by_slot)
    ref = [_hf_logits(peft(a), p) for a, p in zip(ADAPTERS, prompts, strict=True)]
    err = max(max_abs(a, b) for a, b in zip(per_req, ref, strict=True))
    rec.check(f"N3.{name}.mixed_fp32_vs_peft", err <= 2e-4, err, 2e-4, "6 prompts, adapters None/a4/a8/a16/a32/a64")
    rec.figure("lora_mixed_fp32", err)
    step_ref = [_hf_logits(peft(a), p + [t])[-1] for a, p, t in zip(ADAPTERS, prompts, tokens, strict=True)]
    err = max_abs(step, torch.stack(step_ref))
    rec.check(f"N4.{name}.decode_step_vs_hf", err <= 2e-4, err, 2e-4, "one decode step sorted by slot")

    matched = total = 0
    ours = decode(runner, prompts, [GREEDY] * len(prompts), 6, slots=slots)
    mismatches = []
    for out, a, p in zip(ours, ADAPTERS, prompts, strict=True):
        ref_tokens, margins = hf_greedy(model_dir, p, 6, None if a is None else adapters[a])
        compared = next((i for i, mg in enumerate(margins) if mg < CLEAR_MARGIN), len(ref_tokens))
        same = next((i for i in range(compared) if out[i] != ref_tokens[i]), compared)
        matched, total = matched + same, total + compared
        if same < compared:
            mismatches.append(f"{a}: {out} vs {ref_tokens}")
    rec.check(f"N4.{name}.greedy_6_steps", not mismatches, f"{matched}/{total}", "all clear-margin steps equal",
              "; ".join(mismatches)[:300])

    errs = {}
    for adapter in ("a64", "a32", "a8"):  # one slot reused by adapters of decreasing rank
        logits, _, _ = _prefill_and_step(runner, [prompts[3]], [5], {5: ids[adapter]})
        errs[adapter] = max_abs(logits[0], _hf_logits(peft(adapter), prompts[3]))
    rec.check(f"N5.{name}.slot_reuse", max(errs.values()) <= 2e-4, errs, 2e-4, "a64 -> a32 -> a8 in slot 5")

    others = random_prompts([random.Random(i).randint(3, 20) for i in range(31)], 1000, seed=3)
    probe = prompts[3]
    alone, _, _ = _prefill_and_step(runner, [probe], [2], ids_by_slot)
    crowd_slots = sorted([(-1 if i % 3 == 0 else 1 + i % 5) for i in range(31)] + [2])
    index = crowd_slots.index(2)
    crowd_prompts = others[:index] + [probe] + others[index:]
    crowd, _, _ = _prefill_and_step(runner, crowd_prompts, crowd_slots, ids_by_slot)
    err = max_abs(alone[0], crowd[index])
    rec.check(f"N6.{name}.batch_invariance_fp32", err <= 1e-4, err, 1e-4, "alone vs among 31 others")

    top1 = decode(runner, prompts, [SamplingParams(temperature=1.0, top_k=1)] * len(prompts), 8, slots=slots)
    greedy = decode(runner, prompts, [GREEDY] * len(prompts), 8, slots=slots)
    rec.check(f"N7.{name}.top_k1_is_greedy", top1 == greedy, top1 == greedy, True)
    seeded = SamplingParams(temperature=1.0, seed=7)
    solo = decode(runner, [prompts[2]], [seeded], 8, slots=[slots[2]])[0]
    batch = decode(runner, prompts, [GREEDY, GREEDY, seeded, GREEDY, GREEDY, GREEDY], 8, slots=slots)[2]
    rec.flag(f"N7.{name}.SEEDED_BATCH_VARIANT", solo != batch, solo == batch, True,
             "a seeded request alone vs in a batch (fp32)")
    del runner
    runner16 = _runner(ctx, model_dir, "bfloat16")
    _load_adapters(runner16, adapters)
    per_req16, _, _ = _prefill_and_step(runner16, prompts, slots, ids_by_slot)
    alone16, _, _ = _prefill_and_step(runner16, [probe], [2], ids_by_slot)
    crowd16, _, _ = _prefill_and_step(runner16, crowd_prompts, crowd_slots, ids_by_slot)
    rec.figure(f"N6_{name}_bf16_batch_invariance", max_abs(alone16[0], crowd16[index]))
    del runner16
    low = []
    for a, p in zip(ADAPTERS, prompts, strict=True):
        model = _hf_bf16(model_dir, None if a is None else adapters[a], ctx.device)
        low.append(_hf_logits(model, p, ctx.device))
        del model
    _calibrated(rec, f"N3.{name}.mixed_bf16", per_req16, low, ref)
    return matched, total
