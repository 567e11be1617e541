"""What the CPU kernel libraries (cpu_ext.py, cpu_gemv.py) share: whether this machine can build and run them, and
building each once per process, on first use, whichever thread asks first."""

from __future__ import annotations

import os
import platform
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), []))


def unavailable_reason(required_flags: tuple[str, ...]) -> str | None:
    """Why kernels needing these CPU flags cannot be built and run here, or None if they can."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"needs Linux on x86_64, not {platform.system()} on {platform.machine()}"
    flags = cpu_flags()
    missing = [flag for flag in required_flags if flag not in flags]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    compiler = os.environ.get("CXX", "c++")  # what both builds run
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    return None


class BuiltOnce(Generic[T]):
    """build() run on the first call only, its result (None too: the build failed or cannot run) kept after."""

    def __init__(self, build: Callable[[], T | None]):
        self._build = build
        self._lock = threading.Lock()
        self._result: tuple[T | None] | None = None

    def __call__(self) -> T | None:
        if self._result is None:
            with self._lock:
                if self._result is None:
                    self._result = (self._build(),)
        return self._result[0]
