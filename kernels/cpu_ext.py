"""Builds and loads the AVX-512 CPU kernels (csrc/cpu_kernels.cpp) for bfloat16: LoRA shrink/expand (lora_torch),
paged decode attention (worker/layers/attention.py), RMSNorm and SiLU-and-multiply (worker/layers/ops.py).

Compiled on first use with torch's extension builder (g++ and ninja; ~30 s, cached under TORCH_EXTENSIONS_DIR) on
CPUs with AVX-512 BF16. Anywhere else, or when the build fails, `kernels()` is None. A worker asks once, at start-up,
through its backend (kernels/backend.py: `--lora-backend cpu`, or `auto` in bfloat16 on such a CPU), which hands the
module to the attention backend and the model's ops (worker/layers/ops.py) at start-up."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from types import ModuleType

from loraplex.kernels import cpu_build
from loraplex.kernels.progress import elapsed

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
# -fopenmp: at::parallel_for on torch's own OpenMP threads (the same libgomp.so.1 torch loads)
COMPILER_FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]


def unavailable_reason() -> str | None:
    """Why these kernels cannot run here, or None if they can (before building them)."""
    return cpu_build.unavailable_reason(REQUIRED_CPU_FLAGS)


def _build() -> ModuleType | None:
    reason = unavailable_reason()
    if reason is not None:
        logger.info("CPU kernels cannot run here (%s)", reason)
        return None
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    logger.info("building the CPU kernels (AVX-512 BF16; first time on this machine takes ~30 s)")
    start = time.perf_counter()
    try:
        with elapsed(logger, "building the CPU kernels"):
            module = load(
                # Named by the source's digest: checkouts of other versions share the extensions cache, and torch's
                # builder would load one's build for another's source under a fixed name.
                name=f"loraplex_cpu_kernels_{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}",
                sources=[str(SOURCE)],
                extra_cflags=COMPILER_FLAGS,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as e:  # no compiler, no ninja, a toolchain without these intrinsics: fall back, say why
        logger.warning("CPU kernels failed to build: %s", str(e).splitlines()[-1:])
        return None
    logger.info("CPU kernels ready in %.1f s", time.perf_counter() - start)
    return module


# The compiled module (built on the first call, ~30 s once per machine), or None where it cannot run.
kernels = cpu_build.BuiltOnce(_build)


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; a venv's (the ninja package) is not on it unless the venv is active."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # the build fails and says so
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
