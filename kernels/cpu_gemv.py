"""Builds and loads the skinny-matrix kernels for a decode step's linears: 1-32 rows of activations against a whole
bfloat16 or INT8/INT4 weight read once per call (worker/layers/packed.py and worker/quant/avx2.py lay the weights out
and call them). Two builds of one C interface: csrc/gemv_avx512.cpp on CPUs with AVX-512 BF16 (bf16 by
_mm512_dpbf16_ps), else csrc/gemv_avx2.cpp on CPUs with AVX2, FMA and F16C.

Each is compiled on first use into a plain shared library called through ctypes (~2 s with the compiler alone, where
a torch extension takes a minute: only ATen/Parallel.h is included; cached by the source's digest under
TORCH_EXTENSIONS_DIR). The AVX2 one is its own library because cpu_ext's extension is built for AVX-512 and would not
load there. `kernels()` is None where neither can run or the build fails."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
from loraplex.kernels import cpu_build
from loraplex.kernels.progress import elapsed

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"


@dataclass(frozen=True)
class Isa:
    """One build of the kernels: its source, the CPU flags it needs and the compiler flags it takes."""

    name: str  # "AVX2", "AVX-512"
    source: Path
    cpu_flags: tuple[str, ...]
    compiler_flags: tuple[str, ...]


AVX512 = Isa("AVX-512", CSRC / "gemv_avx512.cpp", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
             ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mf16c"))
AVX2 = Isa("AVX2", CSRC / "gemv_avx2.cpp", ("avx2", "fma", "f16c"), ("-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"))
SOURCE, REQUIRED_CPU_FLAGS, COMPILER_FLAGS = AVX2.source, AVX2.cpu_flags, list(AVX2.compiler_flags)


def unavailable_reason(isa: Isa | None = None) -> str | None:
    """Why these kernels (the best build this CPU runs, or `isa`'s) cannot run here, or None if they can (before
    building them)."""
    if isa is None:
        return None if cpu_build.unavailable_reason(AVX512.cpu_flags) is None else unavailable_reason(AVX2)
    return cpu_build.unavailable_reason(isa.cpu_flags)


def _build(isa: Isa) -> ctypes.CDLL | None:
    reason = unavailable_reason(isa)
    if reason is not None:
        logger.info("%s decode kernels cannot run here (%s)", isa.name, reason)
        return None
    import torch
    import torch.utils.cpp_extension as cpp_extension

    digest = hashlib.sha256(isa.source.read_bytes() + " ".join(isa.compiler_flags).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions") / "loraplex"
    library = cache / f"{isa.source.stem}_{digest}.so"
    if not library.exists():
        torch_lib = Path(torch.__file__).parent / "lib"
        includes = [f"-I{path}" for path in cpp_extension.include_paths()]
        cache.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")  # renamed into place whole: builders may race
        command = [os.environ.get("CXX", "c++"), *isa.compiler_flags, "-std=c++17", "-shared", "-fPIC", *includes,
                   str(isa.source), "-o", str(partial), f"-L{torch_lib}", "-ltorch_cpu", "-lc10",
                   f"-Wl,-rpath,{torch_lib}"]
        try:
            with elapsed(logger, f"building the {isa.name} decode kernels"):
                subprocess.run(command, check=True, capture_output=True, text=True)
            partial.replace(library)
        except (OSError, subprocess.CalledProcessError) as e:  # a toolchain without these intrinsics: torch's path
            logger.warning("%s decode kernels failed to build: %s", isa.name,
                           (getattr(e, "stderr", "") or str(e))[-500:])
            return None
    lib = ctypes.CDLL(str(library))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.loraplex_gemv_bf16.argtypes = [ptr, i64, i64, ptr, i64, ptr]
    functions = [lib.loraplex_gemv_bf16, lib.loraplex_gemv_int]
    lib.loraplex_gemv_bf16.argtypes = [ptr, i64, i64, ptr, i64, ptr]
    lib.loraplex_gemv_int.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64, ptr]
    if isa is AVX512:
        lib.loraplex_gemv_int_bf16.argtypes = lib.loraplex_gemv_int.argtypes
        functions.append(lib.loraplex_gemv_int_bf16)
    for function in functions:
        function.restype = None
    return lib


# Each build's library (built on its first call, ~2 s), or None where it cannot run.
avx512_kernels = cpu_build.BuiltOnce(lambda: _build(AVX512))
avx2_kernels = cpu_build.BuiltOnce(lambda: _build(AVX2))


@functools.cache
def isa() -> Isa | None:
    """The build the kernels below run: AVX-512 (BF16) where the CPU has it, else AVX2, else None (read once: calls
    ask per linear). LORAPLEX_CPU_GEMV_BUILD=avx2 takes the AVX2 build on an AVX-512 CPU (to measure it there)."""
    builds = (AVX2,) if os.environ.get("LORAPLEX_CPU_GEMV_BUILD", "").lower() == "avx2" else (AVX512, AVX2)
    return next((build for build in builds if unavailable_reason(build) is None), None)


def kernels() -> ctypes.CDLL | None:
    """The library of isa()'s build, or None where none runs or its build failed."""
    chosen_isa = isa()
    if chosen_isa is None:
        return None
    return (avx512_kernels if chosen_isa is AVX512 else avx2_kernels)()


def group_multiple() -> int:
    """What group sizes the kernels take (besides one group per row) must be multiples of: a vector's columns."""
    return 32 if isa() is AVX512 else 8


def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (rows, in) float32 · w (out, in) bfloat16ᵀ -> (rows, out) float32; the AVX-512 build rounds x to bfloat16
    first (a bfloat16 model's activations are bfloat16 already), the AVX2 one multiplies it in float32."""
    lib = kernels()
    if x.dtype != torch.float32 or x.dim() != 2 or w.dtype != torch.bfloat16 or not w.is_contiguous():
        raise ValueError("gemv_bf16 takes float32 (rows, in) and a contiguous bfloat16 (out, in)")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{x.shape[0]} rows: the kernels take at most {MAX_ROWS}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns, w {w.shape[1]}")
    x = x.contiguous()
    y = x.new_empty(x.shape[0], w.shape[0])
    lib.loraplex_gemv_bf16(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0], y.data_ptr())
    return y


def gemv_int(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int,
             bits: int, bf16: bool = False) -> torch.Tensor:
    """x (rows, in) float32 · wᵀ with w[n, k] = u[n, k] · scales[n, k // group_size] + biases[n, k // group_size],
    u from q: (out, in) uint8 for 8 bits, (out, ceil(in / 2)) uint8 for 4 (columns 2j, 2j+1 in byte j, low nibble
    first). group_size: a multiple of group_multiple(), or in. `bf16` (the AVX-512 build only): x and w rounded to
    bfloat16 first, as torch's path for a bf16 model computes (twice the product rate, for several rows)."""
    lib = kernels()
    rows, cols = x.shape
    groups = -(-cols // group_size)
    if bits not in (4, 8) or q.dtype != torch.uint8 or not q.is_contiguous():
        raise ValueError("gemv_int takes bits 4 or 8 and a contiguous uint8 q")
    if rows > MAX_ROWS:
        raise ValueError(f"{rows} rows: the kernels take at most {MAX_ROWS}")
    if q.shape[1] != (cols if bits == 8 else -(-cols // 2)) or (group_size % group_multiple() and group_size != cols):
        raise ValueError(f"q {tuple(q.shape)} and group_size {group_size} do not fit {cols} input columns")
    for t in (scales, biases):
        if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != (q.shape[0], groups):
            raise ValueError(f"scales and biases: contiguous float32 ({q.shape[0]}, {groups})")
    x = x.float().contiguous()
    y = x.new_empty(rows, q.shape[0])
    if bf16 and isa() is not AVX512:
        raise ValueError(f"bf16 products need the AVX-512 build, not {getattr(isa(), 'name', None)}")
    function = lib.loraplex_gemv_int_bf16 if bf16 else lib.loraplex_gemv_int
    function(x.data_ptr(), rows, cols, q.data_ptr(), q.shape[0], scales.data_ptr(), biases.data_ptr(), group_size,
             bits, y.data_ptr())
    return y


MAX_ROWS = 32  # from 33 rows on, a GEMM (torch/oneDNN) reuses each weight load more than these kernels do


def chosen() -> bool:
    """Whether the worker's bfloat16 decode linears take these kernels: by default only the AVX2 build, on CPUs without
    AVX-512 BF16. Where AVX-512 BF16 is, oneDNN's packed bf16 GEMM measured as fast at one row and faster from 4
    (docs/BENCHMARKS.md, scripts/bench/gemv.py), so it stays. LORAPLEX_CPU_GEMV=on takes the kernels wherever a build
    runs (the AVX-512 one first), =off never."""
    setting = os.environ.get("LORAPLEX_CPU_GEMV", "auto")
    if setting == "off" or isa() is None:
        return False
    return setting == "on" or isa() is AVX2


def chosen_for_int() -> bool:
    """Whether INT8/INT4 linears take these kernels (worker/quant/avx2.py): wherever bf16 ones do, and by default on
    CPUs with AVX-512 BF16 too, where the AVX-512 build's decode steps measured faster than torch's int8/int4 kernels
    (docs/BENCHMARKS.md, scripts/bench/roofline.py). LORAPLEX_CPU_GEMV=off never."""
    return chosen() or (os.environ.get("LORAPLEX_CPU_GEMV", "auto") == "auto" and isa() is AVX512)
