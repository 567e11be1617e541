"""The Triton and torch APIs the code calls by name, which differ between the supported pairs (docs/GPU.md): ours
(torch 2.13 / triton 3.9) and the GPU image's (torch 2.11 / triton 3.6). Each one below exists, with the signature we
use, in both: triton.knobs (3.4+), GPUTarget(backend, arch, warp_size) and ASTSource(fn, signature, constexprs,
attrs) (3.2+), the driver's _active slot, tl.multiple_of / tl.max_contiguous; torch.cuda.graph's stream and pool
arguments and torch.cuda.Stream(device=...). Checked here against what is installed; none needs a shim."""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl


def test_triton_apis_used_by_kernels_and_aot() -> None:
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.driver import driver

    assert hasattr(knobs.runtime, "jit_cache_hook")  # tests/triton_aot.py
    assert hasattr(driver, "_active")
    target = GPUTarget("cuda", 90, 32)  # kernels/aot.py, tests/triton_aot.py
    assert (target.backend, target.arch, target.warp_size) == ("cuda", 90, 32)
    assert list(inspect.signature(ASTSource.__init__).parameters)[1:5] == ["fn", "signature", "constexprs", "attrs"]
    assert "target" in inspect.signature(triton.compile).parameters
    for name in ("multiple_of", "max_contiguous", "dot", "cdiv", "static_range"):
        assert hasattr(tl, name), name


def test_torch_apis_used_by_cuda_graphs() -> None:
    graph_params = inspect.signature(torch.cuda.graph.__init__).parameters
    assert {"pool", "stream"} <= set(graph_params)
    assert "device" in inspect.signature(torch.cuda.Stream.__new__).parameters
    assert hasattr(torch.cuda, "CUDAGraph") and hasattr(torch.cuda, "device")


def test_supported_versions_are_the_documented_pairs() -> None:
    major_minor = tuple(int(x) for x in triton.__version__.split(".")[:2])
    assert major_minor >= (3, 6), f"triton {triton.__version__} is older than the oldest supported pair (3.6)"
    torch_major_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert torch_major_minor >= (2, 11), torch.__version__
