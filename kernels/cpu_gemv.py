"""Builds and loads the AVX2 skinny-matrix kernels (csrc/gemv_avx2.cpp): a decode step's linears, 1-32 rows of
activations against a whole bfloat16 or INT8/INT4 weight read once per call (worker/layers/gemv.py lays the weights
out and chooses them).

Compiled on first use into a plain shared library called through ctypes (~2 s with the compiler alone, where a torch
extension takes a minute: only ATen/Parallel.h is included; cached by the source's digest under TORCH_EXTENSIONS_DIR)
on x86-64 CPUs with AVX2, FMA and F16C. Its own library, because cpu_ext's extension is built for AVX-512 and would
not load on them. `kernels()` is None where it cannot run or the build fails."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
from pathlib import Path

import torch
from loraplex.kernels import cpu_build
from loraplex.kernels.progress import elapsed

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "gemv_avx2.cpp"
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
COMPILER_FLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"]


def unavailable_reason() -> str | None:
    """Why these kernels cannot run here, or None if they can (before building them)."""
    return cpu_build.unavailable_reason(REQUIRED_CPU_FLAGS)


def _build() -> ctypes.CDLL | None:
    reason = unavailable_reason()
    if reason is not None:
        logger.info("AVX2 decode kernels cannot run here (%s)", reason)
        return None
    import torch
    import torch.utils.cpp_extension as cpp_extension

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(COMPILER_FLAGS).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions") / "loraplex"
    library = cache / f"gemv_avx2_{digest}.so"
    if not library.exists():
        torch_lib = Path(torch.__file__).parent / "lib"
        includes = [f"-I{path}" for path in cpp_extension.include_paths()]
        cache.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")  # renamed into place whole: builders may race
        command = [os.environ.get("CXX", "c++"), *COMPILER_FLAGS, "-std=c++17", "-shared", "-fPIC", *includes,
                   str(SOURCE), "-o", str(partial), f"-L{torch_lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_lib}"]
        try:
            with elapsed(logger, "building the AVX2 decode kernels"):
                subprocess.run(command, check=True, capture_output=True, text=True)
            partial.replace(library)
        except (OSError, subprocess.CalledProcessError) as e:  # a toolchain without these intrinsics: torch's path
            logger.warning("AVX2 decode kernels failed to build: %s", (getattr(e, "stderr", "") or str(e))[-500:])
            return None
    lib = ctypes.CDLL(str(library))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.loraplex_gemv_bf16.argtypes = [ptr, i64, i64, ptr, i64, ptr]
    lib.loraplex_gemv_int.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64, ptr]
    for function in (lib.loraplex_gemv_bf16, lib.loraplex_gemv_int):
        function.restype = None
    return lib


# The compiled library (built on the first call, ~2 s), or None where it cannot run.
kernels = cpu_build.BuiltOnce(_build)


def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (rows, in) float32 · w (out, in) bfloat16ᵀ -> (rows, out) float32."""
    lib = kernels()
    if x.dtype != torch.float32 or x.dim() != 2 or w.dtype != torch.bfloat16 or not w.is_contiguous():
        raise ValueError("gemv_bf16 takes float32 (rows, in) and a contiguous bfloat16 (out, in)")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns, w {w.shape[1]}")
    x = x.contiguous()
    y = x.new_empty(x.shape[0], w.shape[0])
    lib.loraplex_gemv_bf16(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0], y.data_ptr())
    return y


def gemv_int(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int,
             bits: int) -> torch.Tensor:
    """x (rows, in) float32 · wᵀ with w[n, k] = u[n, k] · scales[n, k // group_size] + biases[n, k // group_size],
    u from q: (out, in) uint8 for 8 bits, (out, ceil(in / 2)) uint8 for 4 (columns 2j, 2j+1 in byte j, low nibble
    first). group_size: a multiple of 8, or in."""
    lib = kernels()
    rows, cols = x.shape
    groups = -(-cols // group_size)
    if bits not in (4, 8) or q.dtype != torch.uint8 or not q.is_contiguous():
        raise ValueError("gemv_int takes bits 4 or 8 and a contiguous uint8 q")
    if q.shape[1] != (cols if bits == 8 else -(-cols // 2)) or (group_size % 8 and group_size != cols):
        raise ValueError(f"q {tuple(q.shape)} and group_size {group_size} do not fit {cols} input columns")
    for t in (scales, biases):
        if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != (q.shape[0], groups):
            raise ValueError(f"scales and biases: contiguous float32 ({q.shape[0]}, {groups})")
    x = x.float().contiguous()
    y = x.new_empty(rows, q.shape[0])
    lib.loraplex_gemv_int(x.data_ptr(), rows, cols, q.data_ptr(), q.shape[0], scales.data_ptr(), biases.data_ptr(),
                          group_size, bits, y.data_ptr())
    return y


MAX_ROWS = 32  # from 33 rows on, a GEMM (torch/oneDNN) reuses each weight load more than these kernels do


def chosen() -> bool:
    """Whether the worker's decode linears take these kernels: on CPUs that can run them and lack cpu_ext's AVX-512
    BF16 (where torch's AVX-512 kernels and oneDNN stay). LORAPLEX_CPU_GEMV=on takes them wherever they run (to
    measure them against torch restricted to AVX2: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2), =off never."""
    from loraplex.kernels import cpu_ext

    setting = os.environ.get("LORAPLEX_CPU_GEMV", "auto")
    if setting == "off" or unavailable_reason() is not None:
        return False
    return setting == "on" or cpu_ext.unavailable_reason() is not None
