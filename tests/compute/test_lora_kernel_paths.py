"""The Triton LoRA kernels' serving path: split-K shrink (both sides of the token-count heuristic), shrink_expand in two
launches with no fill, and slice bounds that allow or rule out vector access; each against the float64 reference of
test_kernels (interpreter without a GPU: fp32 and fp16)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from loraplex.kernels import lora_expand, lora_shrink, lora_shrink_triton
from loraplex.kernels.backend import TritonBackend
from loraplex.kernels.lora_expand import column_alignment
from loraplex.kernels.lora_shrink import BLOCK_K, split_k
from torch.profiler import profile

from tests.compute.test_kernels import (
    CASES,
    TOLERANCES,
    base_rows,
    dense_shrink,
    dense_shrink_expand,
    make_batch,
    on_test_device,
    shrink_args,
    shrink_expand_args,
)
from tests.device_helpers import TEST_DEVICE, USES_GPU
from tests.kernel_refs import lora_shrink_expand_triton
from tests.server.test_lora_backends import _weights

SPLIT_IN_DIM = 300  # three split-K programs of 128 features (below), the last one partial
FILL_OPS = {"aten::zero_", "aten::fill_", "aten::zeros", "aten::new_zeros", "aten::zeros_like"}


@pytest.fixture(params=["split", "whole"])
def split_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """split: every batch takes split-K (at 64 features a split, the small dims here split too); whole: none does."""
    monkeypatch.setattr(lora_shrink, "MIN_SPLIT_LEN", 64)
    monkeypatch.setattr(lora_shrink, "SPLIT_K_MAX_TOKENS", 10**6 if request.param == "split" else -1)
    return request.param


SPLIT_SWEEP = [
    pytest.param(case, slices, dtype, id=f"{case}-{slices}-{str(dtype)[6:]}")
    for case in ("mixed", "decode")
    for slices in (1, 3)
    for dtype in (torch.float32, torch.float16)
] + [pytest.param("long", 1, torch.float32, id="long-1-float32")]  # two rank blocks per split (slow: one case)


@pytest.mark.parametrize("case_name, num_slices, dtype", SPLIT_SWEEP)
def test_split_k_matches_reference(case_name: str, num_slices: int, dtype: torch.dtype, split_mode: str) -> None:
    b = make_batch(CASES[case_name], num_slices, dtype, in_dim=SPLIT_IN_DIM)
    assert (split_k(b.x.shape[0], SPLIT_IN_DIM)[1] > 1) == (split_mode == "split")
    tol = TOLERANCES[dtype]
    on_device = on_test_device(b)
    h = lora_shrink_triton(*shrink_args(on_device)).cpu()
    torch.testing.assert_close(h.double(), dense_shrink(b), **tol)
    assert torch.count_nonzero(h[base_rows(b)]) == 0
    # the serving path: the planes go unsummed and uninitialized to the expand
    backend = TritonBackend(TEST_DEVICE)
    meta = backend.prepare(b.seg_indptr.tolist(), b.seg_slots.tolist())
    runs = [lambda y: backend.shrink_expand(y, on_device.x, _weights(b, TEST_DEVICE), meta)]
    if case_name == "mixed":  # the free function (tests, scripts) plans the same launches from the tensors
        runs.append(lambda y: lora_shrink_expand_triton(*shrink_expand_args(on_device, y)))
    for run in runs:
        y = on_device.y.clone()
        run(y)
        y = y.cpu()
        torch.testing.assert_close(y.double(), dense_shrink_expand(b), **tol)
        assert torch.equal(y[base_rows(b)], b.y[base_rows(b)])


@pytest.mark.parametrize(
    "num_tokens, in_dim, num_splits",
    [(1, 14336, 16), (1, 4096, 8), (64, 2048, 4), (1, 1000, 1), (1, 80, 1), (65, 14336, 1), (4096, 4096, 1)],
)
def test_split_k_heuristic(num_tokens: int, in_dim: int, num_splits: int) -> None:
    split_len, splits = split_k(num_tokens, in_dim)
    assert splits == num_splits
    assert split_len % BLOCK_K == 0 and (splits - 1) * split_len < in_dim <= splits * split_len


def _counting_launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    launched: list[str] = []
    for module, name in ((lora_shrink, "_shrink_kernel"), (lora_expand, "_expand_kernel")):
        kernel = getattr(module, name)

        class Counting:
            def __getitem__(self, grid, kernel=kernel, name=name):
                launched.append(name)
                return kernel[grid]

        monkeypatch.setattr(module, name, Counting())
    return launched


@pytest.mark.parametrize("case_name", ["mixed", "decode"])
def test_shrink_expand_is_two_launches_and_no_fill(case_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Per LoRA linear: the shrink and the expand, nothing else on the device (the h planes are allocated, not filled;
    # a split-K sum happens inside the expand). Before: a zero fill of h, then the two kernels.
    b = make_batch(CASES[case_name], 3, torch.float32)
    backend = TritonBackend(TEST_DEVICE)
    meta = backend.prepare(b.seg_indptr.tolist(), b.seg_slots.tolist())
    w, x, y = _weights(b, TEST_DEVICE), b.x.to(TEST_DEVICE), b.y.to(TEST_DEVICE)
    launched = _counting_launches(monkeypatch)
    with profile() as prof:
        backend.shrink_expand(y, x, w, meta)
    assert launched == ["_shrink_kernel", "_expand_kernel"]
    fills = [event.name for event in prof.events() if event.name in FILL_OPS]
    assert not fills


def test_unaligned_slices_take_scalar_access() -> None:
    assert column_alignment([0, 64, 96, 128]) == 8
    assert column_alignment([0, 40]) == 8
    assert column_alignment([0, 37, 57, 64]) == 1
    assert column_alignment([0, 64, 100]) == 1  # the last bound bounds the column mask
    b = make_batch(CASES["mixed"], 3, torch.float32)
    slice_offsets = torch.tensor([0, 37, 57, 64], dtype=torch.int32)
    b = replace(b, slice_offsets=slice_offsets)
    y = on_test_device(b).y.clone()
    lora_shrink_expand_triton(*shrink_expand_args(on_test_device(b), y))
    torch.testing.assert_close(y.cpu().double(), dense_shrink_expand(b), **TOLERANCES[torch.float32])


@pytest.mark.skipif(USES_GPU, reason="this runner is on the CPU (Triton in the interpreter)")
def test_model_forward_launches_two_kernels_per_lora_linear(
    llama_dir, adapter_dirs, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Per decoder layer with an all-module adapter in the batch: qkv, o, gate_up and down each launch the shrink and
    # the expand, 8 launches (before: 8 and 4 zero fills of h).
    from tests.lora_helpers import LORA_CONFIG, MIXED, batch_logits, load_all
    from tests.worker_helpers import make_runner, random_prompts

    runner = make_runner(llama_dir, **LORA_CONFIG, lora_backend="triton")  # the interpreter without a GPU
    load_all(runner, adapter_dirs)
    prompts = random_prompts([3, 2, 1, 2, 1, 1, 2, 1, 2], runner.vocab_size, seed=43)
    launched = _counting_launches(monkeypatch)
    batch_logits(runner, prompts, MIXED)  # a64 targets every module
    num_layers = len(runner.model.model.layers)
    assert launched.count("_shrink_kernel") == launched.count("_expand_kernel") == 4 * num_layers
