"""Builds and loads the AVX2 skinny-matrix kernels (csrc/gemv_avx2.cpp): a decode step's linears, 1-32 rows of
activations against a whole bfloat16 or INT8/INT4 weight read once per call (worker/layers/gemv.py lays the weights
out and chooses them).

Compiled on first use with torch's extension builder (~20 s once per machine, cached under TORCH_EXTENSIONS_DIR) on
x86-64 CPUs with AVX2, FMA and F16C; its own extension, because cpu_ext's is built for AVX-512 and would not load on
them. `kernels()` is None where it cannot run or the build fails."""

from __future__ import annotations

import hashlib
import logging
import platform
import shutil
import os
import threading
from pathlib import Path
from types import ModuleType

from loraplex.kernels.cpu_ext import _put_ninja_on_path
from loraplex.kernels.progress import elapsed

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "gemv_avx2.cpp"
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
COMPILER_FLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"]

_lock = threading.Lock()
_loaded: tuple[ModuleType | None] | None = None


def cpu_flags() -> set[str]:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), []))


def unavailable_reason() -> str | None:
    """Why these kernels cannot run here, or None if they can (before building them)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"needs Linux on x86_64, not {platform.system()} on {platform.machine()}"
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    return None


def kernels() -> ModuleType | None:
    """The compiled module (built on the first call), or None where it cannot run."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = (_build(),)
    return _loaded[0]


def _build() -> ModuleType | None:
    reason = unavailable_reason()
    if reason is not None:
        logger.info("AVX2 decode kernels cannot run here (%s)", reason)
        return None
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    try:
        with elapsed(logger, "building the AVX2 decode kernels"):
            return load(name=f"loraplex_cpu_gemv_{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}",
                        sources=[str(SOURCE)], extra_cflags=COMPILER_FLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler or ninja, a toolchain without these intrinsics: torch's path, and why
        logger.warning("AVX2 decode kernels failed to build: %s", str(e).splitlines()[-1:])
        return None
