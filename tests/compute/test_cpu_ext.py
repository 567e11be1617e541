"""cpu_ext's kernels besides LoRA (test_kernels.py): paged decode attention (sliding windows, attention chunks and
sinks included) against a float64 softmax over the same keys read page by page, RMSNorm and SiLU-and-multiply against
the torch ops they replace, and the kernels' guards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loraplex.kernels import cpu_ext

OFF = cpu_ext.unavailable_reason()
pytestmark = pytest.mark.skipif(OFF is not None, reason=f"CPU kernels cannot run here: {OFF}")
PAGE_SIZE = 16
NO_SINKS = torch.empty(0)


def paged_batch(kv_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, seed: int = 0):
    """Scattered pages (shuffled over a pool with spares), bf16 q/K/V; scores large enough to be decisive."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = [-(-n // PAGE_SIZE) for n in kv_lens]
    num_pages = sum(pages_per_req) + 3
    order = torch.randperm(num_pages, generator=gen)
    read_pages = torch.zeros(len(kv_lens), max(pages_per_req), dtype=torch.int64)  # padding: page 0
    start = 0
    for n, count in enumerate(pages_per_req):
        read_pages[n, :count] = order[start : start + count]
        start += count
    k_cache = torch.randn(num_pages * PAGE_SIZE, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(num_pages * PAGE_SIZE, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    q = (3 * torch.randn(len(kv_lens), num_heads, head_dim, generator=gen)).to(torch.bfloat16)
    return q, k_cache, v_cache, read_pages, torch.tensor(kv_lens, dtype=torch.int64)


def reference(q, k_cache, v_cache, read_pages, kv_lens, window: int = 0, chunk: int = 0,
              sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """float64: the request's last `window` keys (window > 0), those of its last position's chunk (chunk > 0); each
    head's sink logit one more softmax entry of no value."""
    num_reqs, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for n in range(num_reqs):
        length = int(kv_lens[n])
        first = max(0, length - window) if window else 0
        if chunk:
            first = max(first, (length - 1) // chunk * chunk)
        positions = torch.arange(first, length)
        slots = read_pages[n, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        keys, values = k_cache[slots].double(), v_cache[slots].double()  # (len, kv_heads, head_dim)
        for h in range(num_heads):
            scores = keys[:, h // group] @ q[n, h].double() / head_dim**0.5
            if sinks is not None:
                scores = torch.cat([scores, sinks[h : h + 1].double()])
            probs = torch.softmax(scores, 0)[: len(positions)]
            out[n, h] = probs @ values[:, h // group]
    return out


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(4, 4, 64), (4, 2, 64), (16, 4, 64), (8, 1, 128), (4, 2, 128)]
)
def test_decode_attention_matches_reference(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    kernels = cpu_ext.kernels()
    assert kernels is not None, "the CPU kernels failed to build (see the log)"
    assert kernels.decode_attention_supports(num_heads // num_kv_heads, head_dim)
    # one key; exactly a page; one past a page; a long context; lengths that are not multiples of 16
    batch = paged_batch([1, 16, 17, 300, 45, 2], num_heads, num_kv_heads, head_dim)
    out = torch.empty_like(batch[0])
    kernels.decode_attention(*batch, PAGE_SIZE, head_dim**-0.5, 0, 0, NO_SINKS, out)
    torch.testing.assert_close(out.double(), reference(*batch), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [1, 7, 16, 40])
def test_decode_attention_sliding_window(window: int) -> None:
    kernels = cpu_ext.kernels()
    # shorter than, equal to and longer than the window; a window that starts mid-page
    batch = paged_batch([1, 7, 16, 17, 300, 45], 8, 2, 64, seed=window)
    out = torch.empty_like(batch[0])
    kernels.decode_attention(*batch, PAGE_SIZE, 64**-0.5, window, 0, NO_SINKS, out)
    expected = reference(*batch, window=window)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    assert (expected - reference(*batch)).abs()[4].max() > 0.1  # the window changes the long request's output


@pytest.mark.parametrize(("window", "chunk", "with_sinks"), [(0, 0, True), (7, 0, True), (0, 24, False),
                                                          (40, 24, True)])  # fmt: skip
def test_decode_attention_sinks_and_chunks(window: int, chunk: int, with_sinks: bool) -> None:
    # gpt-oss's sinks (with its sliding window) and Llama 4's chunks: a chunk's first key, its last, mid-page starts
    kernels = cpu_ext.kernels()
    batch = paged_batch([1, 24, 25, 47, 300, 45], 8, 2, 64, seed=window + chunk)
    sinks = (2 * torch.randn(8, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16) if with_sinks else None
    out = torch.empty_like(batch[0])
    kernels.decode_attention(*batch, PAGE_SIZE, 64**-0.5, window, chunk, NO_SINKS if sinks is None else sinks, out)
    expected = reference(*batch, window=window, chunk=chunk, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    assert (expected - reference(*batch, window=window)).abs().max() > 0.1  # the sinks or the chunk change it


def test_decode_attention_shapes_it_is_not_built_for() -> None:
    kernels = cpu_ext.kernels()
    assert not kernels.decode_attention_supports(3, 64) and not kernels.decode_attention_supports(4, 96)
    q, k_cache, v_cache, read_pages, kv_lens = paged_batch([5], 6, 2, 64)
    with pytest.raises(RuntimeError, match="unsupported group 3"):
        kernels.decode_attention(q, k_cache, v_cache, read_pages, kv_lens, PAGE_SIZE, 0.125, 0, 0, NO_SINKS,
                                 torch.empty_like(q))  # fmt: skip


@pytest.mark.parametrize("bad", ["page", "length"])
def test_decode_attention_refuses_reads_outside_the_cache(bad: str) -> None:
    kernels = cpu_ext.kernels()
    q, k_cache, v_cache, read_pages, kv_lens = paged_batch([20, 7], 4, 2, 64)
    if bad == "page":
        read_pages[1, 0] = k_cache.shape[0] // PAGE_SIZE  # one past the last page
    else:
        kv_lens[0] = read_pages.shape[1] * PAGE_SIZE + 1  # more keys than its page table holds
    with pytest.raises(RuntimeError, match="reads page|keys"):
        kernels.decode_attention(q, k_cache, v_cache, read_pages, kv_lens, PAGE_SIZE, 0.125, 0, 0, NO_SINKS,
                                 torch.empty_like(q))  # fmt: skip


def test_lora_kernels_refuse_a_slot_outside_the_pool() -> None:
    kernels = cpu_ext.kernels()
    x = torch.randn(3, 32).to(torch.bfloat16)
    lora_a = torch.zeros(2, 8, 32, dtype=torch.bfloat16)
    h = torch.empty(3, 8, dtype=torch.bfloat16)
    ranks = torch.full((2,), 8, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="uses slot 2 of a pool of 2"):
        kernels.shrink(x, lora_a, torch.tensor([0, 2, -1]), ranks, 1, h)


def test_rms_norm_rounds_as_the_torch_ops() -> None:
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(37, 1000, generator=gen)).to(torch.bfloat16)  # dim not a multiple of 16: masked tail
    weight = (torch.rand(1000, generator=gen) + 0.5).to(torch.bfloat16)
    x_fp32 = x.float()
    expected = weight * (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(cpu_ext.kernels().rms_norm(x, weight, 1e-6), expected)


def test_silu_and_mul_rounds_as_the_torch_ops() -> None:
    gen = torch.Generator().manual_seed(2)
    gate_up = (4 * torch.randn(37, 2 * 700, generator=gen)).to(torch.bfloat16)
    gate_up[0, :4] = torch.tensor([-30.0, 30.0, 0.0, 88.5])  # saturating and zero inputs
    gate, up = gate_up.chunk(2, dim=-1)
    out = cpu_ext.kernels().silu_and_mul(gate_up)
    expected = F.silu(gate) * up
    assert (out == expected).float().mean() > 0.999  # the exp differs from Sleef's in the last float bits
    torch.testing.assert_close(out, expected, atol=1e-30, rtol=8e-3)  # at most one bfloat16 step apart
