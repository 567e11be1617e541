"""The Triton paged attention kernels (kernels/paged_attention.py) against their torch references, and the references
against SDPA on the contiguous keys and values they were paged from. Under Triton's interpreter on a CPU (fp32,
fp16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from loraplex.kernels import paged_attention as pa

import tests.triton_aot as triton_aot
from tests import kernel_refs
from tests.device_helpers import TEST_DEVICE  # conftest has set TRITON_INTERPRET where no GPU is used

TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


@dataclass
class Paged:
    """Requests whose keys/values were written into shuffled cache pages, and their contiguous originals."""

    q: torch.Tensor  # (tokens, heads, d): every request's new tokens, flat, with `filler` rows between requests
    k_cache: torch.Tensor  # (slots, kv_heads, d)
    v_cache: torch.Tensor
    page_table: torch.Tensor  # (reqs, max_pages) int32, padded with page 0
    keys: list[torch.Tensor]  # per request (kv_len, kv_heads, d)
    values: list[torch.Tensor]
    q_starts: list[int]
    q_lens: list[int]
    cached_lens: list[int]
    page_size: int


def make_paged(cached_lens: list[int], q_lens: list[int], *, heads: int, kv_heads: int, head_dim: int,
               page_size: int, dtype: torch.dtype, filler: int = 1, seed: int = 0) -> Paged:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [c + n for c, n in zip(cached_lens, q_lens, strict=True)]
    pages_needed = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages_needed) + 3  # spare pages stay random: a kernel that reads past its pages shows it
    order = torch.randperm(num_pages, generator=gen).tolist()
    k_cache = torch.randn(num_pages * page_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages * page_size, kv_heads, head_dim, generator=gen).to(dtype)
    table, keys, values, q_starts = [], [], [], []
    row = filler
    for kv_len, n_pages in zip(kv_lens, pages_needed, strict=True):
        pages, order = order[:n_pages], order[n_pages:]
        table.append(pages)
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(kv_len)],
                             dtype=torch.long)  # fmt: skip
        keys.append(k_cache[slots].clone())
        values.append(v_cache[slots].clone())
    for q_len in q_lens:
        q_starts.append(row)
        row += q_len + filler
    width = max(1, max(len(p) for p in table))
    page_table = torch.tensor([p + [0] * (width - len(p)) for p in table], dtype=torch.int32)
    q = torch.randn(row, heads, head_dim, generator=gen).to(dtype)
    return Paged(q, k_cache, v_cache, page_table, keys, values, q_starts, list(q_lens), list(cached_lens), page_size)


def sdpa_reference(p: Paged, req: int, scale: float, window: int = 0, chunk: int = 0) -> torch.Tensor:
    """(q_len, heads, d) in fp32 from the request's contiguous keys: causal, bottom-right aligned; with a window > 0
    a query at position p sees keys at (p - window, p], with a chunk > 0 those at [p - p % chunk, p]."""
    q_len, cached = p.q_lens[req], p.cached_lens[req]
    q = p.q[p.q_starts[req] : p.q_starts[req] + q_len].float().transpose(0, 1)  # (heads, q_len, d)
    k = p.keys[req].float().transpose(0, 1)  # (kv_heads, kv_len, d)
    v = p.values[req].float().transpose(0, 1)
    kv_pos = torch.arange(cached + q_len)
    q_pos = (cached + torch.arange(q_len))[:, None]
    mask = kv_pos[None, :] <= q_pos
    if window > 0:
        mask &= kv_pos[None, :] > q_pos - window
    if chunk > 0:
        mask &= kv_pos[None, :] >= q_pos - q_pos % chunk
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def decode_args(p: Paged, out: torch.Tensor, num_splits: int, scale: float) -> tuple:
    kv_lens = [c + n for c, n in zip(p.cached_lens, p.q_lens, strict=True)]
    return (out, p.q, p.k_cache, p.v_cache, p.page_table, int32(kv_lens), int32(p.q_starts), p.page_size, scale,
            num_splits)  # fmt: skip


def to_device(args: tuple) -> tuple:
    return tuple(a.to(TEST_DEVICE) if isinstance(a, torch.Tensor) else a for a in args)


def run_both(launch_torch, launch_triton, args: tuple, out_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ref_args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    launch_torch(*ref_args)
    dev_args = to_device(args)
    launch_triton(*dev_args)
    return ref_args[out_index], dev_args[out_index].cpu()


DECODE_CASES = {
    # name: (kv_lens, heads, kv_heads, head_dim, page_size, num_splits)
    "mha_ragged": ([1, 16, 17, 64, 65, 130], 4, 4, 64, 16, 1),
    "gqa4_split3": ([1, 16, 17, 64, 129, 300], 8, 2, 64, 16, 3),
    "gqa8_more_splits_than_blocks": ([1, 2, 70], 16, 2, 32, 4, 16),
    "page1_gqa2": ([1, 5, 33, 100], 4, 2, 32, 1, 2),
    "head_dim_80": ([7, 90, 200], 6, 2, 80, 16, 4),
    "gqa16": ([3, 150], 16, 1, 64, 16, 2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode(case: str, dtype: torch.dtype) -> None:
    kv_lens, heads, kv_heads, head_dim, page_size, num_splits = DECODE_CASES[case]
    p = make_paged([n - 1 for n in kv_lens], [1] * len(kv_lens), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   page_size=page_size, dtype=dtype)  # fmt: skip
    scale = head_dim**-0.5
    sentinel = torch.full_like(p.q, 7.0)  # rows that are not a decode's must stay untouched
    ref, tri = run_both(kernel_refs.paged_decode_attention_torch, pa.paged_decode_attention_triton,
                        decode_args(p, sentinel, num_splits, scale))  # fmt: skip
    for req, start in enumerate(p.q_starts):
        torch.testing.assert_close(ref[start : start + 1].float(), sdpa_reference(p, req, scale),
                                   **TOLERANCES[dtype])  # fmt: skip
    torch.testing.assert_close(tri, ref, **TOLERANCES[dtype])
    others = torch.ones(p.q.shape[0], dtype=torch.bool)
    others[p.q_starts] = False
    assert torch.equal(tri[others], sentinel[others])


def test_decode_splits_agree_and_empty_request_is_zero() -> None:
    # Any split count gives the same result; a request with no keys (a padding row of a CUDA graph) gives zeros.
    p = make_paged([0, 40, 99], [1, 1, 1], heads=4, kv_heads=2, head_dim=32, page_size=4, dtype=torch.float32)
    args = list(to_device(decode_args(p, torch.empty_like(p.q), 1, 0.2)))
    args[5] = args[5].clone()
    args[5][0] = 0  # request 0: no keys
    outs = []
    for num_splits in (1, 2, 5, 16):
        args[0] = torch.full_like(args[1], 3.0)
        args[9] = num_splits
        pa.paged_decode_attention_triton(*args)
        outs.append(args[0][p.q_starts].cpu())
    for out in outs:
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=1e-5)


EXTEND_CASES = {
    # name: (cached_lens, q_lens, heads, kv_heads, head_dim, page_size)
    "prefills_and_prefix": ([0, 5, 100, 0], [7, 70, 3, 1], 4, 2, 64, 16),
    "long_chunk_gqa4": ([17], [130], 8, 2, 32, 16),
    "page1": ([0, 3], [9, 20], 2, 1, 32, 1),
    "head_dim_80_mha": ([64, 0], [65, 2], 3, 3, 80, 8),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(EXTEND_CASES))
def test_extend(case: str, dtype: torch.dtype) -> None:
    cached_lens, q_lens, heads, kv_heads, head_dim, page_size = EXTEND_CASES[case]
    p = make_paged(cached_lens, q_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                   dtype=dtype, filler=2)  # fmt: skip
    scale = head_dim**-0.5
    tile_reqs, tile_offsets = pa.plan_extend_tiles(q_lens)
    sentinel = torch.full_like(p.q, 7.0)
    args = (sentinel, p.q, p.k_cache, p.v_cache, p.page_table, int32(p.q_starts), int32(q_lens), int32(cached_lens),
            int32(tile_reqs), int32(tile_offsets), page_size, scale)  # fmt: skip
    ref, tri = run_both(kernel_refs.paged_extend_attention_torch, pa.paged_extend_attention_triton, args)
    own = torch.zeros(p.q.shape[0], dtype=torch.bool)
    for req, (start, q_len) in enumerate(zip(p.q_starts, q_lens, strict=True)):
        own[start : start + q_len] = True
        torch.testing.assert_close(ref[start : start + q_len].float(), sdpa_reference(p, req, scale),
                                   **TOLERANCES[dtype])  # fmt: skip
    torch.testing.assert_close(tri, ref, **TOLERANCES[dtype])
    assert torch.equal(tri[~own], sentinel[~own])


# (window, logit cap): a window inside the first key block, one across blocks and splits, a cap alone, both.
WINDOW_CAP_CASES = [(5, 0.0), (70, 0.0), (0, 1.5), (40, 1.5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("window", "logit_cap"), WINDOW_CAP_CASES)
def test_decode_sliding_window_and_soft_cap(window: int, logit_cap: float, dtype: torch.dtype) -> None:
    kv_lens = [1, 5, 6, 17, 64, 129, 300]
    p = make_paged([n - 1 for n in kv_lens], [1] * len(kv_lens), heads=8, kv_heads=2, head_dim=64, page_size=16,
                   dtype=dtype)  # fmt: skip
    scale = 0.3  # large scores, so the cap bites
    args = (*decode_args(p, torch.full_like(p.q, 7.0), 3, scale), window, logit_cap)
    ref, tri = run_both(kernel_refs.paged_decode_attention_torch, pa.paged_decode_attention_triton, args)
    torch.testing.assert_close(tri, ref, **TOLERANCES[dtype])
    if not logit_cap:  # the reference's window is SDPA's
        for req, start in enumerate(p.q_starts):
            torch.testing.assert_close(ref[start : start + 1].float(), sdpa_reference(p, req, scale, window),
                                       **TOLERANCES[dtype])  # fmt: skip
    plain = decode_args(p, torch.full_like(p.q, 7.0), 3, scale)
    kernel_refs.paged_decode_attention_torch(*plain)
    assert (plain[0][p.q_starts[-1]] - ref[p.q_starts[-1]]).abs().max() > 0.05  # the window or cap changes it


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("window", "logit_cap"), WINDOW_CAP_CASES)
def test_extend_sliding_window_and_soft_cap(window: int, logit_cap: float, dtype: torch.dtype) -> None:
    cached_lens, q_lens = [0, 5, 100, 0, 30], [7, 70, 3, 1, 130]
    p = make_paged(cached_lens, q_lens, heads=4, kv_heads=2, head_dim=32, page_size=16, dtype=dtype, filler=2)
    scale = 0.3
    tile_reqs, tile_offsets = pa.plan_extend_tiles(q_lens)
    args = (torch.full_like(p.q, 7.0), p.q, p.k_cache, p.v_cache, p.page_table, int32(p.q_starts), int32(q_lens),
            int32(cached_lens), int32(tile_reqs), int32(tile_offsets), 16, scale, window, logit_cap)  # fmt: skip
    ref, tri = run_both(kernel_refs.paged_extend_attention_torch, pa.paged_extend_attention_triton, args)
    torch.testing.assert_close(tri, ref, **TOLERANCES[dtype])
    if not logit_cap:
        for req, (start, q_len) in enumerate(zip(p.q_starts, q_lens, strict=True)):
            torch.testing.assert_close(ref[start : start + q_len].float(), sdpa_reference(p, req, scale, window),
                                       **TOLERANCES[dtype])  # fmt: skip


# (window, num_splits): sinks (gpt-oss) alone, with a window, and added once across the decode splits' merge
SINK_CASES = [(0, 1), (5, 1), (0, 3), (70, 3)]


@pytest.mark.parametrize(("window", "num_splits"), SINK_CASES)
def test_decode_with_sinks(window: int, num_splits: int) -> None:
    kv_lens = [1, 5, 17, 129, 300]
    p = make_paged([n - 1 for n in kv_lens], [1] * len(kv_lens), heads=8, kv_heads=2, head_dim=32, page_size=16,
                   dtype=torch.float32)  # fmt: skip
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(5)) * 2.0  # (heads,)
    args = (*decode_args(p, torch.full_like(p.q, 7.0), num_splits, 0.3), window, 0.0, sinks)
    ref, tri = run_both(kernel_refs.paged_decode_attention_torch, pa.paged_decode_attention_triton, args)
    torch.testing.assert_close(tri, ref, **TOLERANCES[torch.float32])
    plain = decode_args(p, torch.full_like(p.q, 7.0), num_splits, 0.3)
    kernel_refs.paged_decode_attention_torch(*plain, window)
    assert (plain[0][p.q_starts[0]] - ref[p.q_starts[0]]).abs().max() > 0.05  # the sinks take their share


@pytest.mark.parametrize("window", [0, 40])
def test_extend_with_sinks(window: int) -> None:
    cached_lens, q_lens = [0, 5, 100, 30], [7, 70, 3, 130]
    p = make_paged(cached_lens, q_lens, heads=4, kv_heads=2, head_dim=32, page_size=16, dtype=torch.float32, filler=2)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(6)) * 2.0
    tile_reqs, tile_offsets = pa.plan_extend_tiles(q_lens)
    args = (torch.full_like(p.q, 7.0), p.q, p.k_cache, p.v_cache, p.page_table, int32(p.q_starts), int32(q_lens),
            int32(cached_lens), int32(tile_reqs), int32(tile_offsets), 16, 0.3, window, 0.0, sinks)  # fmt: skip
    ref, tri = run_both(kernel_refs.paged_extend_attention_torch, pa.paged_extend_attention_triton, args)
    torch.testing.assert_close(tri, ref, **TOLERANCES[torch.float32])


FP32, FP16 = torch.float32, torch.float16
# (chunk, page_size, window, num_splits, dtype): chunks inside a page, across pages and key blocks, with a window and
# with splits
CHUNK_CASES = [(4, 16, 0, 1, FP16), (24, 16, 0, 3, FP32), (80, 16, 0, 2, FP32), (24, 8, 10, 1, FP32)]


@pytest.mark.parametrize(("chunk", "page_size", "window", "num_splits", "dtype"), CHUNK_CASES)
def test_decode_chunked(chunk: int, page_size: int, window: int, num_splits: int, dtype: torch.dtype) -> None:
    # Llama 4's chunked local attention: the new token at p - 1 sees its chunk's keys only (a chunk's first key, its
    # last, one past a chunk, several chunks back)
    kv_lens = [1, 5, 25, 81, 170]
    p = make_paged([n - 1 for n in kv_lens], [1] * len(kv_lens), heads=4, kv_heads=2, head_dim=32,
                   page_size=page_size, dtype=dtype)  # fmt: skip
    args = (*decode_args(p, torch.full_like(p.q, 7.0), num_splits, 0.3), window, 0.0, None, chunk)
    ref, tri = run_both(kernel_refs.paged_decode_attention_torch, pa.paged_decode_attention_triton, args)
    torch.testing.assert_close(tri, ref, **TOLERANCES[dtype])
    for req, start in enumerate(p.q_starts):
        torch.testing.assert_close(ref[start : start + 1].float(), sdpa_reference(p, req, 0.3, window, chunk),
                                   **TOLERANCES[dtype])  # fmt: skip
    plain = decode_args(p, torch.full_like(p.q, 7.0), num_splits, 0.3)
    kernel_refs.paged_decode_attention_torch(*plain, window)
    assert (plain[0][p.q_starts[-1]] - ref[p.q_starts[-1]]).abs().max() > 0.05  # the chunk changes it


@pytest.mark.parametrize(("chunk", "page_size", "window", "dtype"), [(4, 16, 0, FP16), (80, 16, 0, FP32),
                                                                    (24, 8, 10, FP32)])  # fmt: skip
def test_extend_chunked(chunk: int, page_size: int, window: int, dtype: torch.dtype) -> None:
    # prefills from 0 and after cached prefixes that end inside a chunk, a row tile spanning several chunks
    cached_lens, q_lens = [0, 5, 23, 100], [9, 70, 3, 30]
    p = make_paged(cached_lens, q_lens, heads=4, kv_heads=2, head_dim=32, page_size=page_size, dtype=dtype, filler=2)
    tile_reqs, tile_offsets = pa.plan_extend_tiles(q_lens)
    args = (torch.full_like(p.q, 7.0), p.q, p.k_cache, p.v_cache, p.page_table, int32(p.q_starts), int32(q_lens),
            int32(cached_lens), int32(tile_reqs), int32(tile_offsets), page_size, 0.3, window, 0.0, None,
            chunk)  # fmt: skip
    ref, tri = run_both(kernel_refs.paged_extend_attention_torch, pa.paged_extend_attention_triton, args)
    torch.testing.assert_close(tri, ref, **TOLERANCES[dtype])
    for req, (start, q_len) in enumerate(zip(p.q_starts, q_lens, strict=True)):
        torch.testing.assert_close(ref[start : start + q_len].float(), sdpa_reference(p, req, 0.3, window, chunk),
                                   **TOLERANCES[dtype])  # fmt: skip


def test_plans() -> None:
    assert pa.plan_extend_tiles([1, 64, 65, 0, 3], block_m=64) == ([0, 1, 2, 2, 4], [0, 0, 0, 64, 0])
    assert pa.decode_num_splits(1, 8, 100) == 1  # short: one split
    assert pa.decode_num_splits(1, 8, 8192) == pa.MAX_SPLITS  # one long request: split as far as allowed
    assert pa.decode_num_splits(128, 8, 4096) == 1  # the batch fills the device already
    assert pa.decode_num_splits(4, 8, 1024) == 4  # by length
    assert 1 <= pa.decode_num_splits(3, 1, 10**6) <= pa.MAX_SPLITS


@pytest.mark.parametrize(
    "bad",
    ["page_table_int64", "kv_lens_short", "out_shape", "cache_dtype", "splits_zero", "splits_many", "heads_not_mult",
     "page_size_not_dividing"],
)  # fmt: skip
@pytest.mark.parametrize("launch", [kernel_refs.paged_decode_attention_torch, pa.paged_decode_attention_triton],
                         ids=["torch", "triton"])  # fmt: skip
def test_decode_rejects(launch, bad: str) -> None:
    p = make_paged([3, 9], [1, 1], heads=4, kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32)
    args = list(decode_args(p, torch.empty_like(p.q), 1, 0.25))
    if bad == "page_table_int64":
        args[4] = args[4].long()
    elif bad == "kv_lens_short":
        args[5] = args[5][:1]
    elif bad == "out_shape":
        args[0] = args[0][:, :2]
    elif bad == "cache_dtype":
        args[2] = args[2].half()
    elif bad == "splits_zero":
        args[9] = 0
    elif bad == "splits_many":
        args[9] = pa.MAX_SPLITS + 1
    elif bad == "heads_not_mult":
        args[0], args[1] = args[0][:, :3], args[1][:, :3]
    elif bad == "page_size_not_dividing":
        args[7] = 5
    with pytest.raises(ValueError, match="paged_decode_attention"):
        launch(*args)


def test_extend_rejects_mismatched_tiles() -> None:
    p = make_paged([0], [5], heads=2, kv_heads=1, head_dim=16, page_size=4, dtype=torch.float32)
    args = (torch.empty_like(p.q), p.q, p.k_cache, p.v_cache, p.page_table, int32([1]), int32([5]), int32([0]),
            int32([0, 0]), int32([0]), 4, 0.25)  # fmt: skip
    with pytest.raises(ValueError, match="tile_offsets"):
        pa.paged_extend_attention_triton(*args)


def test_every_variant_compiles_for_sm90_and_sm80() -> None:
    # In a child without the interpreter (tests/triton_aot.py): the start-up warm-up's launches compiled for each
    # target through ptxas, and a sweep of real batches (decodes short and long, prefills with and without a prefix,
    # both mixed) meets no variant the warm-up did not compile.
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "triton_aot.py")], env=env,
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert len(results) == 2 * len(triton_aot.ATTENTION_CONFIGS)
    for result in results:
        where = f"sm_{result['arch']} {result['dtype']} {result['shape']} page {result['page_size']}"
        assert len(result["compiled"]) == triton_aot.KERNELS_PER_CONFIG, where
        assert sorted(result["serving_keys"]) == result["warmup_keys"], where
        for compiled in result["compiled"]:
            assert compiled["arch"] == result["arch"]
            assert compiled["shared_bytes"] <= triton_aot.SHARED_LIMIT[result["arch"]], (where, compiled)


# ---- the worker's choice of backend, and its start-up warm-up ----------------------------------------------------


def test_attention_backend_flag_and_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex.frontend.entrypoints.cli import config_from_args
    from loraplex.protocol.config import ServerConfig
    from loraplex.worker.layers.attention import AttentionBackendError, SDPAAttention, select_attention_backend
    from loraplex.worker.layers.triton_attention import TritonAttention

    assert ServerConfig().attention_backend == "auto"
    assert config_from_args(["--attention-backend", "triton"]).attention_backend == "triton"
    with pytest.raises(SystemExit):
        config_from_args(["--attention-backend", "flashinfer"])
    heads = (4, 2, 64)  # this rank's query heads, KV heads, head_dim
    assert type(select_attention_backend("auto", "cpu", *heads)) is SDPAAttention
    assert type(select_attention_backend("auto", "cuda", *heads)) is TritonAttention  # chosen, nothing launched
    assert type(select_attention_backend("torch", "cuda", *heads)) is SDPAAttention
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(AttentionBackendError, match="--attention-backend triton needs a CUDA device"):
        select_attention_backend("triton", "cpu", *heads)
    with pytest.raises(AttentionBackendError, match="--attention-backend cpu needs the compiled CPU kernels"):
        select_attention_backend("cpu", "cpu", *heads)


class _FakeCPUKernels:
    """Stands in for cpu_ext's module: which head shapes its decode attention takes."""

    @staticmethod
    def decode_attention_supports(query_heads_per_kv_head: int, head_dim: int) -> bool:
        return head_dim == 64


def test_cpu_attention_backend_selection() -> None:
    from loraplex.worker.layers.attention import (
        AttentionBackendError,
        CPUAttention,
        SDPAAttention,
        select_attention_backend,
    )

    kernels = _FakeCPUKernels()
    # auto: the CPU kernels' decode where the worker built them and they take the shapes, else SDPA
    assert type(select_attention_backend("auto", "cpu", 4, 2, 64, kernels)) is CPUAttention
    assert type(select_attention_backend("auto", "cpu", 4, 2, 32, kernels)) is SDPAAttention
    assert type(select_attention_backend("torch", "cpu", 4, 2, 64, kernels)) is SDPAAttention
    assert type(select_attention_backend("cpu", "cpu", 4, 2, 64, kernels)) is CPUAttention
    with pytest.raises(AttentionBackendError, match="does not take 2 query heads per KV head of 32 dims"):
        select_attention_backend("cpu", "cpu", 4, 2, 32, kernels)


@pytest.mark.skipif(TEST_DEVICE.type == "cuda", reason="the interpreter's warm-up, on the CPU")
def test_worker_warms_up_the_attention_kernels(llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from tests.worker_helpers import make_runner

    with caplog.at_level(logging.INFO, logger="loraplex.worker.model_runner"):
        runner = make_runner(llama_dir, attention_backend="triton")
    assert runner.attention.name == "triton"
    assert "attention backend: triton (--attention-backend triton)" in caplog.text
    assert "triton attention kernels compiled: 4 launches in" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("layer", [None, (20, 0.0), (20, 2.0)], ids=["plain", "window", "window_cap"])
def test_mixed_batch_through_the_backend_matches_sdpa(dtype: torch.dtype, layer: tuple | None) -> None:
    # GPU_CHECK.md G2's layout scaled down: decodes of ragged lengths and prefills with and without a cached prefix,
    # interleaved in one batch on shuffled pages; the triton backend's one output against the torch (SDPA) backend's.
    from loraplex.protocol.structs import ForwardReq, SamplingParams
    from loraplex.worker.batch_inputs import BatchInputs
    from loraplex.worker.layers.attention import SDPAAttention
    from loraplex.worker.layers.attention_spec import LayerAttention
    from loraplex.worker.layers.triton_attention import TritonAttention

    heads, kv_heads, head_dim, page_size, num_pages = 8, 2, 64, 16, 96
    specs = [(0, 1), (0, 7), (15, 1), (5, 100), (16, 1), (63, 1), (100, 130), (128, 1), (299, 1), (0, 1)]
    pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1)).tolist()
    reqs = []
    for cached, new in specs:
        n = -(-(cached + new) // page_size)
        reqs.append(ForwardReq(input_ids=[0] * new, num_cached_tokens=cached, page_ids=pages[:n],
                               sampling=SamplingParams()))  # fmt: skip
        pages = pages[n:]
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(2, (num_pages + 1) * page_size, kv_heads, head_dim, generator=gen).to(dtype)
    num_tokens = sum(new for _, new in specs)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    outs = {}
    for backend in (SDPAAttention(torch.device("cpu")), TritonAttention(TEST_DEVICE, kv_heads)):
        device = backend.device
        inputs = BatchInputs.build(reqs, page_size, num_pages, 4096, device, backend).attention
        assert (inputs.decode is not None and inputs.extend is not None) if backend.name == "triton" else True
        spec = None if layer is None else LayerAttention(scale=0.2, sliding_window=layer[0], logit_cap=layer[1] or None)
        outs[backend.name] = inputs.attend(q.to(device), cache[0].to(device), cache[1].to(device), spec).cpu()
    torch.testing.assert_close(outs["triton"].float(), outs["torch"].float(), **TOLERANCES[dtype])
