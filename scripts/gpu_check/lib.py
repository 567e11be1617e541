"""What every group of scripts/gpu_check/runner.py shares: the check recorder, the child entry point, timing helpers and
the direct writers of large random checkpoints and adapters (no transformers model built in memory).

Each group is a function `group_fn(ctx: Context) -> None` in one of the gpu_check_*.py modules; it records checks
and figures on `ctx.rec` and never returns a status: the recorder derives it. Groups run in a spawned child
(`run_group`), so a CUDA fault or a hang cannot poison the parent or the next group.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.protocol.adapters.lora_targets import ATTN_MODULES, TARGET_MODULES

REPO_ROOT = Path(__file__).resolve().parents[2]
NOT_IMPLEMENTED = "not implemented yet"
KEEP_PGID_ENV = "GPU_CHECK_KEEP_PGID"


def _jsonable(value: Any) -> Any:
    """Floats that JSON cannot hold (nan, inf) become strings; tensors and numpy scalars become Python values."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return _jsonable(value.item())
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


class Recorder:
    """One group's checks and figures, written to part_<group>.json after every check, so a group killed at its cap
    still leaves what it did. Prints one line per check as it goes."""

    def __init__(self, group: str, part_path: Path):
        self.group = group
        self.part_path = part_path
        self.part: dict[str, Any] = {
            "status": "running", "wall_s": 0.0, "reason": None, "checks": [], "figures": {}, "error_tail": None,
        }
        self._start = time.monotonic()
        self.write()

    def check(self, name: str, ok: bool, value: Any = None, threshold: Any = None, detail: str = "") -> bool:
        self._add(name, "check", bool(ok), value, threshold, detail)
        return bool(ok)

    def flag(self, name: str, raised: bool, value: Any = None, threshold: Any = None, detail: str = "") -> None:
        """A performance finding: never fails the run; listed in the summary's perf_flags when raised."""
        self._add(name, "flag", not raised, value, threshold, detail)

    def skip(self, name: str, reason: str) -> None:
        self._add(name, "skip", None, None, None, reason)

    def figure(self, key: str, value: Any) -> None:
        self.part["figures"][key] = _jsonable(value)
        self.write()

    def _add(self, name: str, kind: str, ok: bool | None, value: Any, threshold: Any, detail: str) -> None:
        entry = {"name": name, "kind": kind, "pass": ok, "value": _jsonable(value),
                 "threshold": _jsonable(threshold), "detail": detail}
        self.part["checks"].append(entry)
        print(f"  [{self.group}] {format_check(entry)}", flush=True)
        self.write()

    def finish(self, status: str | None = None, reason: str | None = None, error_tail: str | None = None) -> None:
        checks = self.part["checks"]
        if status is None:
            failed = any(c["kind"] == "check" and c["pass"] is False for c in checks)
            ran = any(c["kind"] != "skip" for c in checks)
            status = "fail" if failed else "pass" if ran else "skipped"
            if status == "skipped" and reason is None and checks:
                reason = checks[0]["detail"]
        self.part.update(status=status, reason=reason, error_tail=error_tail)
        self.write()

    def write(self) -> None:
        self.part["wall_s"] = round(time.monotonic() - self._start, 2)
        tmp = self.part_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.part, indent=1))
        tmp.replace(self.part_path)


def format_check(c: dict) -> str:
    if c["kind"] == "skip":
        return f"SKIP {c['name']}: {c['detail']}"
    word = ("PASS" if c["pass"] else "FAIL") if c["kind"] == "check" else ("ok  " if c["pass"] else "FLAG")
    detail = f" ({c['detail']})" if c["detail"] else ""
    return f"{word} {c['name']}: {_short(c['value'])} vs {_short(c['threshold'])}{detail}"


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class Context:
    """What a group gets: where to write, the device it runs on, and the options of the run."""

    group: str
    out_dir: Path  # what comes back from the GPU machine: only the report, the log, env.txt and server_tail.log
    dry_run: bool
    rec: Recorder
    keep_models: Path | None = None
    ceilings: dict[str, float] = field(default_factory=dict)  # from G0: copy_GBps, bf16_gemm_TFLOPs, h2d_pinned_GBps
    work_dir: Path | None = None  # the run's scratch directory (part files, server logs): never shipped back
    cap_s: float = 0.0  # this group's hard cap (the parent kills it there)

    @property
    def scratch(self) -> Path:
        return self.work_dir or self.out_dir

    def own_process_group(self, pid: int) -> None:
        """Register a process group this group started in its own session (a server): the parent kills it when
        the group ends or is killed at its cap, so no server holds GPU memory through the next groups."""
        with open(self.scratch / f"pgids_{self.group}.txt", "a") as f:
            f.write(f"{pid}\n")

    @property
    def device(self):  # torch.device; imported lazily, the parent never imports torch
        import torch

        return torch.device("cpu" if self.dry_run else "cuda", 0 if not self.dry_run else None)

    @property
    def is_cuda(self) -> bool:
        return not self.dry_run

    @property
    def lora_backend(self) -> str:
        """--lora-backend for the runners: the default (Triton) on the GPU; torch ops on a dry run, where the
        interpreter would be slow and the CPU kernels a build."""
        return "auto" if self.is_cuda else "torch"

    def reps(self, n: int = 20) -> int:
        return 2 if self.dry_run else n

    def warmups(self, n: int = 3) -> int:
        return 1 if self.dry_run else n

    def skip_unless_cuda(self, name: str) -> bool:
        """Record `name` as skipped on a CPU dry run; True when the caller should go on."""
        if self.is_cuda:
            return True
        self.rec.skip(name, "dry-run: needs CUDA")
        return False


def run_group(group: str, module: str, func: str, out_dir: str, work_dir: str, dry_run: bool,
              keep_models: str | None, ceilings: dict[str, float], cap_s: float) -> None:
    """Child entry point (multiprocessing spawn target): run one group, always leave part_<group>.json behind in
    work_dir. The child leads a process group of its own, so the parent's kill at the cap takes everything it
    started too (TP ranks, compute-sanitizer), not only itself. A run nested under G8's compute-sanitizer keeps its
    group (KEEP_PGID_ENV): G8 kills that whole session at once."""
    if not os.environ.get(KEEP_PGID_ENV):
        os.setpgid(0, 0)
    rec = Recorder(group, Path(work_dir) / f"part_{group}.json")
    try:
        fn: Callable[[Context], None] = getattr(importlib.import_module(module), func)
        ctx = Context(group, Path(out_dir), dry_run, rec, Path(keep_models) if keep_models else None, ceilings,
                      Path(work_dir), cap_s)
        if ctx.is_cuda:
            import torch

            torch.cuda.set_device(0)  # Triton launches on the current device, not the tensor's
        fn(ctx)
        rec.finish()
    except BaseException as e:  # recorded as a value: the parent reads it from the part file
        tail = "".join(traceback.format_exception(e))[-3000:]
        print(tail, file=sys.stderr, flush=True)
        rec.finish("error", f"{type(e).__name__}: {str(e)[:300]}", tail)


# Peak HBM bandwidth by device name (GB/s, the vendor's figure): the memory roofline of a decode step is the bytes
# of the weights it reads over this. Unknown devices fall back to the copy bandwidth G0 measured.
HBM_GBPS = {"H200": 4800.0, "GH200": 4000.0, "H100 NVL": 3900.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0,
            "H100": 3350.0, "B200": 8000.0, "A100-SXM4-80GB": 2039.0, "A100 80GB PCIe": 1935.0, "A100": 1555.0,
            "L40S": 864.0, "L4": 300.0}


def hbm_bandwidth(device_name: str, measured_copy_gbps: float | None) -> tuple[float | None, str]:
    """(GB/s, where it came from): the longest table key contained in the device name, else the measured copy."""
    matches = [key for key in HBM_GBPS if key.lower() in device_name.lower()]
    if matches:
        key = max(matches, key=len)
        return HBM_GBPS[key], f"table: {key}"
    return measured_copy_gbps, "measured device-to-device copy (device not in the table)"


# ---- timing ------------------------------------------------------------------------------------------------------


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device, *, reps: int, warmups: int) -> list[float]:
    """Per-call ms of fn: CUDA events on a GPU (device time), perf_counter around a sync on a CPU."""
    import torch

    for _ in range(warmups):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def wall_ms(fn: Callable[[], Any], device) -> float:
    """One call's wall time, ending on a device sync (first-call and step times)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def max_rel_err(got, ref) -> float:
    """max|got - ref| / max|ref| in float64 (0 for two empty tensors)."""
    if got.numel() == 0:
        return 0.0
    ref64 = ref.double()
    return float((got.double() - ref64).abs().max() / ref64.abs().max().clamp_min(1e-30))


def max_abs(a, b) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


# ---- direct checkpoint writers (no HF model in memory; weights drawn on the target device) --------------------------


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_pos: int = 4096
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """module -> (out, in) of its HF weight."""
        h, kv, i = self.hidden, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
                "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}

    def num_params(self, vocab: int) -> int:
        per_layer = sum(o * i for o, i in self.module_shapes().values()) + 2 * self.hidden
        return self.layers * per_layer + 2 * vocab * self.hidden + self.hidden


def write_llama(out_dir: Path, shape: LlamaShape, device, dtype, seed: int = 0) -> int:
    """A random Llama checkpoint with HF names (std 0.02, norms 1), its config and the demo tokenizer; returns the
    vocab size."""
    import torch
    from safetensors.torch import save_file

    from tests.builders import _token_ids, build_tokenizer, tokenizer_vocab_size

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = tokenizer_vocab_size()
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int):
        return (torch.randn(size, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype).cpu()

    tensors = {"model.embed_tokens.weight": randn(vocab, shape.hidden), "lm_head.weight": randn(vocab, shape.hidden),
               "model.norm.weight": torch.ones(shape.hidden, dtype=dtype)}
    for layer in range(shape.layers):
        prefix = f"model.layers.{layer}"
        for module, (out_f, in_f) in shape.module_shapes().items():
            part = "self_attn" if module in ATTN_MODULES else "mlp"
            tensors[f"{prefix}.{part}.{module}.weight"] = randn(out_f, in_f)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}.{norm}.weight"] = torch.ones(shape.hidden, dtype=dtype)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    ids = _token_ids()
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": shape.hidden, "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "intermediate_size": shape.intermediate,
        "max_position_embeddings": shape.max_pos, "rope_theta": shape.rope_theta, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "head_dim": shape.head_dim, "bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"],
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    build_tokenizer(out_dir)
    return vocab


def write_adapter(out_dir: Path, shape: LlamaShape, r: int, alpha: float, device, dtype, seed: int,
                  modules: tuple[str, ...] = TARGET_MODULES) -> None:
    """A PEFT adapter with A/B std chosen so that scale·BA has ~0.1× the base weights' std (0.02)."""
    import torch
    from safetensors.torch import save_file

    scale = alpha / r
    std = (0.1 * 0.02 / (scale * r**0.5)) ** 0.5
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for layer in range(shape.layers):
        for module in modules:
            out_f, in_f = shape.module_shapes()[module]
            part = "self_attn" if module in ATTN_MODULES else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            for name, size in (("lora_A", (r, in_f)), ("lora_B", (out_f, r))):
                values = torch.randn(size, generator=gen, device=device, dtype=torch.float32) * std
                tensors[f"{key}.{name}.weight"] = values.to(dtype).cpu()
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
              "target_modules": list(modules), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "use_dora": False, "inference_mode": True, "base_model_name_or_path": None, "modules_to_save": None}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})
