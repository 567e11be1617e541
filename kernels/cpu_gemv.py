"""Builds and loads the CPU linears' kernels: rows of activations against a whole bfloat16 or INT8/INT4 weight read
once per call (worker/layers/packed.py and worker/quant/avx2.py call them on weights packed here once at load). Two
builds: csrc/gemv_avx512.cpp on CPUs with AVX-512 BF16 (the weight in blocks of 16 output rows, every product an exact
bfloat16 one by _mm512_dpbf16_ps, any number of rows), else csrc/gemv_avx2.cpp on CPUs with AVX2, FMA and F16C (the
weight as stored, row by row, float32 products, up to 32 rows). `pack_bf16`/`pack_int` lay a weight out for the build
in use and `gemv` multiplies by it, whichever build that is.

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
import torch.nn.functional as F
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
    if isa is AVX512:
        functions = [lib.loraplex_gemv_blocked]
        lib.loraplex_gemv_blocked.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, i64, i64, ptr, ptr]
    else:
        functions = [lib.loraplex_gemv_bf16, lib.loraplex_gemv_int]
        lib.loraplex_gemv_bf16.argtypes = [ptr, i64, i64, ptr, i64, ptr]
        lib.loraplex_gemv_int.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64, ptr]
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


BLOCK_ROWS = 16  # output rows per block of the AVX-512 layout
COLUMNS_PER_VECTOR = {16: 2, 8: 4, 4: 8}  # bits -> input columns in one 64-byte vector of a block


@dataclass(frozen=True)
class PackedWeight:
    """A linear's weight laid out for the kernels of the build in use (isa() when packed).

    AVX-512 (`blocked`): data (blocks, groups, vectors, 64) uint8 — output rows in blocks of 16, each block one run of
    64-byte vectors over the input columns (padded with zeros), lane pair (2j, 2j+1) of every vector row j's, and for
    INT each group's vectors followed by two of its 16 rows' float32 scales and biases (scales and biases are None).
    AVX2: data as stored — (out, in) bfloat16, or (out, in) / (out, ceil(in / 2)) uint8 (columns 2j, 2j+1 in byte j,
    low nibble first); scales and biases (out, groups). INT weights are w = u · scale + bias per group of input
    columns; bits 16 is a bfloat16 weight (one group, no scales)."""

    data: torch.Tensor
    scales: torch.Tensor | None
    biases: torch.Tensor | None
    bits: int
    out_features: int
    in_features: int
    group_size: int
    blocked: bool

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.biases) if t is not None)

    def unpack(self, rows: slice) -> torch.Tensor:
        """Output rows `rows` (start and stop multiples of BLOCK_ROWS, or the end) as (rows, in): the bfloat16 weight,
        or the INT values u as uint8."""
        start, stop, _ = rows.indices(self.out_features)
        if not self.blocked:
            data = self.data[start:stop]
            if self.bits == 4:
                data = torch.stack([data & 0xF, data >> 4], dim=-1).flatten(1)[:, : self.in_features]
            return data
        assert start % BLOCK_ROWS == 0, "rows start at a block"
        data = self.data[start // BLOCK_ROWS : -(-stop // BLOCK_ROWS)]
        blocks, groups = data.shape[:2]
        if self.bits != 16:
            data = data[:, :, :-2]  # the scales and biases
        data = data.reshape(blocks, -1, 64)
        vectors = data.shape[1]
        if self.bits == 16:  # [b, c, j, p] -> [b, j, c, p]
            out = data.view(torch.bfloat16).view(blocks, vectors, BLOCK_ROWS, 2).permute(0, 2, 1, 3)
        elif self.bits == 8:  # [b, c, j, p, i] -> [b, j, c, i, p]
            out = data.view(blocks, vectors, BLOCK_ROWS, 2, 2).permute(0, 2, 1, 4, 3)
        else:  # [b, c, j, p, byte] -> nibbles [b, j, c, i, p] with i = 2 byte + (high nibble)
            nibbles = torch.stack([data & 0xF, data >> 4], dim=-1).view(blocks, vectors, BLOCK_ROWS, 2, 4)
            out = nibbles.permute(0, 2, 1, 4, 3)
        out = out.reshape(blocks * BLOCK_ROWS, -1)
        return out[: stop - start, : self.in_features]

    def group_params(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The INT scales and biases of output rows `rows` (as unpack takes them), each (rows, groups) float32."""
        start, stop, _ = rows.indices(self.out_features)
        if not self.blocked:
            return self.scales[start:stop], self.biases[start:stop]
        params = self.data[start // BLOCK_ROWS : -(-stop // BLOCK_ROWS), :, -2:].view(torch.float32)
        blocks, groups = params.shape[:2]  # [b, g, scale|bias, j] -> [b, j, g] each
        return tuple(params[:, :, i].permute(0, 2, 1).reshape(blocks * BLOCK_ROWS, groups)[: stop - start]
                     for i in (0, 1))  # fmt: skip


def _pad(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, -t.shape[dim] % multiple]
    return F.pad(t, pad) if pad[-1] else t


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """(out, ...) padded with zero rows to whole blocks, as (blocks, BLOCK_ROWS, ...)."""
    t = _pad(t, 0, BLOCK_ROWS)
    return t.view(t.shape[0] // BLOCK_ROWS, BLOCK_ROWS, *t.shape[1:])


def pack_bf16(w: torch.Tensor) -> PackedWeight:
    """The (out, in) bfloat16 weight laid out for the build in use."""
    if w.dtype != torch.bfloat16 or w.dim() != 2:
        raise ValueError("pack_bf16 takes a bfloat16 (out, in) weight")
    out_features, in_features = w.shape
    if isa() is not AVX512:
        return PackedWeight(w.contiguous(), None, None, 16, out_features, in_features, in_features, False)
    blocks = _blocks(_pad(w, 1, 2))  # [b, j, c, p]
    data = blocks.view(blocks.shape[0], BLOCK_ROWS, -1, 2).permute(0, 2, 1, 3).contiguous()
    return PackedWeight(data.view(torch.uint8).view(data.shape[0], 1, -1, 64), None, None, 16, out_features,
                        in_features, in_features, True)  # fmt: skip


def pack_int(u: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int, bits: int) -> PackedWeight:
    """INT values u (out, in) uint8 (< 2**bits) with w = u · scales + biases per group of group_size input columns
    (scales, biases: (out, groups) float32; group_size a multiple of group_multiple(), or in) laid out for the build
    in use."""
    out_features, in_features = u.shape
    groups = -(-in_features // group_size)
    if bits not in (4, 8) or u.dtype != torch.uint8:
        raise ValueError("pack_int takes bits 4 or 8 and uint8 values")
    if group_size < in_features and (group_size % group_multiple() or in_features % group_size):
        raise ValueError(f"group_size {group_size} does not fit {in_features} input columns")
    for t in (scales, biases):
        if t.dtype != torch.float32 or tuple(t.shape) != (out_features, groups):
            raise ValueError(f"scales and biases: float32 ({out_features}, {groups})")
    if isa() is not AVX512:
        data = u
        if bits == 4:
            data = _pad(u, 1, 2)
            data = data[:, 0::2] | (data[:, 1::2] << 4)
        return PackedWeight(data.contiguous(), scales.contiguous(), biases.contiguous(), bits, out_features,
                            in_features, group_size, False)  # fmt: skip
    cols = COLUMNS_PER_VECTOR[bits]
    values = _blocks(_pad(u, 1, cols))
    num_blocks = values.shape[0]
    if bits == 8:  # [b, j, c, i, p] -> [b, c, j, p, i]: lane (j, p)'s word holds columns p (byte 0) and 2 + p
        data = values.view(num_blocks, BLOCK_ROWS, -1, 2, 2).permute(0, 2, 1, 4, 3)
    else:  # [b, j, c, i, p]: nibble i of lane (j, p)'s word holds column 2i + p
        v = values.view(num_blocks, BLOCK_ROWS, -1, 4, 2)
        low, high = v[:, :, :, 0] | (v[:, :, :, 1] << 4), v[:, :, :, 2] | (v[:, :, :, 3] << 4)  # [b, j, c, p]
        data = torch.stack([low, high], dim=-1).permute(0, 2, 1, 3, 4)  # [b, c, j, p, byte]
    data = data.contiguous().view(num_blocks, groups, -1, 64)
    params = [_blocks(t.float()).permute(0, 2, 1).contiguous().view(torch.uint8) for t in (scales, biases)]
    data = torch.cat([data, params[0][:, :, None], params[1][:, :, None]], dim=2)  # [b, g, vectors | scales | biases]
    return PackedWeight(data.contiguous(), None, None, bits, out_features, in_features, group_size, True)


def gemv(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, in) · wᵀ + bias -> (rows, out) in x's dtype (float32 or bfloat16; bias (out) in it too, added to the
    float32 sums before the one rounding): any number of rows on the AVX-512 build, at most MAX_ROWS on the AVX2 one
    (takes_rows). The AVX-512 build multiplies in bfloat16 with float32 sums — a bfloat16 x as it is, a float32 x split
    into three bfloat16 parts that sum to it — and reads and writes bfloat16 itself; the AVX2 one multiplies in
    float32."""
    lib = kernels()
    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"gemv takes float32 or bfloat16 (rows, {w.in_features}), not {x.dtype} {tuple(x.shape)}")
    if not takes_rows(w, x.shape[0]):
        raise ValueError(f"{x.shape[0]} rows: the AVX2 kernels take at most {MAX_ROWS}")
    if w.blocked != (isa() is AVX512):
        raise ValueError("the weight was packed for another build")
    if bias is not None and tuple(bias.shape) != (w.out_features,):
        raise ValueError(f"bias {tuple(bias.shape)} for {w.out_features} outputs")
    rows = x.shape[0]
    if w.blocked:
        x = x.contiguous()
        y = x.new_empty(rows, w.out_features)
        bias = None if bias is None else bias.to(x.dtype).contiguous()
        lib.loraplex_gemv_blocked(x.data_ptr(), rows, w.in_features, w.data.data_ptr(), w.out_features, w.group_size,
                                  w.bits, 1, int(x.dtype == torch.bfloat16), 0 if bias is None else bias.data_ptr(),
                                  y.data_ptr())  # fmt: skip
        return y
    x32 = x.float().contiguous()
    y = x32.new_empty(rows, w.out_features)
    if w.bits == 16:
        lib.loraplex_gemv_bf16(x32.data_ptr(), rows, w.in_features, w.data.data_ptr(), w.out_features, y.data_ptr())
    else:
        lib.loraplex_gemv_int(x32.data_ptr(), rows, w.in_features, w.data.data_ptr(), w.out_features,
                              w.scales.data_ptr(), w.biases.data_ptr(), w.group_size, w.bits, y.data_ptr())  # fmt: skip
    if bias is not None:
        y += bias
    return y.to(x.dtype)


MAX_ROWS = 32  # the AVX2 build's: from 33 rows on, torch's GEMM reuses each weight load more than it does


def takes_rows(w: PackedWeight, rows: int) -> bool:
    """Whether the kernels multiply `rows` rows by w: the AVX-512 build any number (at 512 rows within ~15 % of
    oneDNN's GEMM, where unpacking the weight for it cost 1.5-3x: scripts/bench/gemv.py), the AVX2 one MAX_ROWS."""
    return w.blocked or rows <= MAX_ROWS


def chosen() -> bool:
    """Whether the worker's bfloat16 linears take these kernels: wherever a build runs (AVX-512 BF16, else AVX2) but on
    CPUs with AMX, whose tile GEMM in oneDNN outruns AVX-512 products from a few rows on. On AVX-512 the blocked layout
    replaces the weight and takes every row count: the bench model's bf16 decode step measured 1.7x faster at one
    request and 1.1x at 32 than on oneDNN (docs/BENCHMARKS.md, scripts.bench.roofline). LORAPLEX_CPU_GEMV=on takes
    them on AMX CPUs too, =off never (oneDNN's packed GEMM)."""
    setting = os.environ.get("LORAPLEX_CPU_GEMV", "auto")
    if setting == "off" or isa() is None:
        return False
    return setting == "on" or "amx_bf16" not in cpu_build.cpu_flags()


def chosen_for_int() -> bool:
    """Whether INT8/INT4 linears (worker/quant/avx2.py) take these kernels: wherever a build runs, faster than torch's
    int8/int4 kernels at every row count measured; LORAPLEX_CPU_GEMV=off never."""
    return os.environ.get("LORAPLEX_CPU_GEMV", "auto") != "off" and isa() is not None

