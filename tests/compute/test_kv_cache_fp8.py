"""The FP8 KV cache (--kv-cache-dtype fp8): attention over it equals attention over a float32 cache holding the same
dequantized keys and values, and stays within the format's error of the unquantized cache; scales come from the
checkpoint or the first prefill; a worker's greedy tokens are unchanged where the reference's choice is clear; the
cache takes a quarter of float32's bytes per token, so a memory budget holds four times the tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from loraplex.kernels import cpu_ext
from loraplex.protocol.config import ConfigError, ServerConfig
from loraplex.protocol.structs import ForwardReq
from loraplex.worker.kv_cache import FP8_DTYPE, KVCache, default_kv_tokens, dequantize_fp8, quantize_fp8
from loraplex.worker.layers.attention import SDPAAttention, paged_attention
from loraplex.worker.layers.attention_spec import LayerAttention
from loraplex.worker.model.config import ModelConfigError
from safetensors.torch import load_file, save_file

from tests.worker_helpers import GREEDY, decode, make_runner, prefill_logits, random_prompts

PAGE = 4
FP8_MARGIN = 0.5  # logits: a reference choice closer than this may flip under the FP8 cache's rounding


def _attend(cache: KVCache, q, k, v, reqs: list[ForwardReq], layer: LayerAttention) -> torch.Tensor:
    """One layer's paged attention of the batch `reqs` (q, k, v their new tokens) through the torch backend."""
    starts, row = [], 0
    for req in reqs:
        starts.append(row)
        row += len(req.input_ids)
    width = max(len(r.page_ids) for r in reqs)
    tables = torch.tensor([r.page_ids + [0] * (width - len(r.page_ids)) for r in reqs])  # padded with page 0
    slots = torch.tensor([r.page_ids[p // PAGE] * PAGE + p % PAGE for r in reqs
                          for p in range(r.num_cached_tokens, r.num_cached_tokens + len(r.input_ids))])  # fmt: skip
    inputs = SDPAAttention(torch.device("cpu")).build(reqs, starts, tables, slots, PAGE)
    kv = cache.layer(0)
    return paged_attention(q, k, v, kv[0], kv[1], inputs, layer, kv.scales)


def test_attention_over_fp8_equals_attention_over_its_dequantized_values() -> None:
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim = 4, 2, 16
    # a prefill (9 tokens) and a decode after 6 cached tokens, on scattered pages
    reqs = [ForwardReq(input_ids=[1] * 9, num_cached_tokens=0, page_ids=[5, 1, 3]),
            ForwardReq(input_ids=[1], num_cached_tokens=6, page_ids=[0, 4])]  # fmt: skip
    args = dict(num_layers=1, num_pages=6, page_size=PAGE, num_kv_heads=kv_heads, head_dim=head_dim,
                device=torch.device("cpu"))  # fmt: skip
    fp8, exact, plain = (KVCache(dtype=d, **args) for d in (FP8_DTYPE, torch.float32, torch.float32))
    fp8.scales.copy_(torch.tensor([[0.05, 0.04]]))  # the largest values (~15) well inside 448 * scale
    # the decode's cached keys and values, written as a previous pass would have
    old_k, old_v = (torch.randn(6, kv_heads, head_dim, generator=gen) * 3 for _ in range(2))
    old_slots = torch.tensor([0, 1, 2, 3, 16, 17])
    for cache in (fp8, exact, plain):
        kv = cache.layer(0)
        if cache is fp8:
            kv[0].view(torch.uint8)[old_slots] = quantize_fp8(old_k, fp8.scales[0, :1]).view(torch.uint8)
            kv[1].view(torch.uint8)[old_slots] = quantize_fp8(old_v, fp8.scales[0, 1:]).view(torch.uint8)
        else:
            kv[0][old_slots], kv[1][old_slots] = old_k, old_v
    q = torch.randn(10, heads, head_dim, generator=gen)
    k, v = (torch.randn(10, kv_heads, head_dim, generator=gen) * 3 for _ in range(2))
    layer = LayerAttention.default(head_dim)
    out_fp8 = _attend(fp8, q, k, v, reqs, layer)
    # the exact cache holds what the FP8 one stores, dequantized: every key and value, old and new
    deq = [dequantize_fp8(t.view(torch.uint8).view(FP8_DTYPE), s, torch.float32)
           for t, s in zip(fp8.layer(0), (fp8.scales[0, :1], fp8.scales[0, 1:]), strict=True)]  # fmt: skip
    exact.kv[0, 0].copy_(deq[0])
    exact.kv[0, 1].copy_(deq[1])
    q_k, q_v = (dequantize_fp8(quantize_fp8(t, s), s, torch.float32) for t, s in ((k, fp8.scales[0, :1]),
                                                                                   (v, fp8.scales[0, 1:])))  # fmt: skip
    torch.testing.assert_close(out_fp8, _attend(exact, q, q_k, q_v, reqs, layer), atol=1e-6, rtol=1e-6)
    # against the unquantized cache: within e4m3's rounding (3 mantissa bits: <= 1/16 relative per value)
    reference = _attend(plain, q, k, v, reqs, layer)
    assert (out_fp8 - reference).abs().max() < 0.25 * reference.abs().max()
    assert (out_fp8 - reference).norm() < 0.08 * reference.norm()


def test_values_beyond_the_format_saturate_instead_of_turning_nan() -> None:
    x = torch.tensor([1000.0, -1000.0, 3.0, 1e-4])
    stored = quantize_fp8(x, torch.tensor([1.0]))
    assert stored.float().tolist()[:3] == [448.0, -448.0, 3.0] and not stored.float().isnan().any()


def test_a_memory_budget_holds_four_times_the_tokens_of_float32(llama_dir: Path) -> None:
    plain, fp8 = make_runner(llama_dir), make_runner(llama_dir, kv_cache_dtype="fp8")
    mc = plain.model_config
    assert plain.kv_bytes_per_token == 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4
    assert fp8.kv_bytes_per_token * 4 == plain.kv_bytes_per_token
    assert fp8.kv_cache.kv.dtype == FP8_DTYPE and fp8.kv_cache.kv.nbytes * 4 == plain.kv_cache.kv.nbytes
    budget = dict(max_running_requests=64, context_length=2048, device=torch.device("cpu"))
    tokens = [default_kv_tokens(bytes_per_token=r.kv_bytes_per_token, **budget) for r in (plain, fp8)]
    assert tokens[1] >= min(4 * tokens[0], 64 * 2048)


def test_greedy_tokens_are_unchanged_where_the_choice_is_clear(llama_dir: Path) -> None:
    ref, fp8 = make_runner(llama_dir), make_runner(llama_dir, kv_cache_dtype="fp8", calculate_kv_scales=True)
    prompts = random_prompts([7, 12, 5, 9], ref.vocab_size, seed=3)
    expected = decode(ref, prompts, [GREEDY] * len(prompts), 8)
    outputs = decode(fp8, prompts, [GREEDY] * len(prompts), 8)
    # the first prefill set the scales: amax / 224 of each layer's keys and values, no longer 1.0
    assert not fp8._kv_scales_pending and (fp8.kv_cache.scales != 1.0).all() and (fp8.kv_cache.scales > 0).all()
    num_compared = 0
    for prompt, out, want in zip(prompts, outputs, expected, strict=True):
        logits = prefill_logits(ref, prompt + want[:-1])[len(prompt) - 1 :]  # (steps, vocab), teacher-forced
        top2 = logits.topk(2, dim=-1).values
        for step, margin in enumerate((top2[:, 0] - top2[:, 1]).tolist()):
            if margin < FP8_MARGIN:
                break
            assert out[step] == want[step], f"step {step}: {out} vs {want}"
            num_compared += 1
    assert num_compared >= 3


def test_scales_come_from_the_checkpoint(llama_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(llama_dir, tmp_path / "m")
    (shard,) = (tmp_path / "m").glob("*.safetensors")
    tensors = load_file(shard)
    tensors.update({"model.layers.0.self_attn.k_scale": torch.tensor(0.05),
                    "model.layers.0.self_attn.v_scale": torch.tensor(0.03),
                    "model.layers.1.self_attn.kv_scale": torch.tensor([0.07])})  # fmt: skip
    save_file(tensors, shard)
    runner = make_runner(tmp_path / "m", kv_cache_dtype="fp8_e4m3")
    torch.testing.assert_close(runner.kv_cache.scales, torch.tensor([[0.05, 0.03], [0.07, 0.07]]))
    # the model's own dtype: the scales are read by nothing, and the checkpoint serves as before
    prompt = random_prompts([6], runner.vocab_size, seed=0)[0]
    torch.testing.assert_close(prefill_logits(make_runner(tmp_path / "m"), prompt),
                               prefill_logits(make_runner(llama_dir), prompt))  # fmt: skip


def test_choices_it_cannot_serve_are_refused(llama_dir: Path, tmp_path: Path) -> None:
    from tests.mla_models import build_mla_model

    with pytest.raises(ConfigError, match="--calculate-kv-scales .* needs --kv-cache-dtype fp8"):
        ServerConfig(calculate_kv_scales=True)
    with pytest.raises(ModelConfigError, match="--kv-cache-dtype bfloat16 holds the model's own dtype only"):
        make_runner(llama_dir, kv_cache_dtype="bfloat16")  # a float32 model
    build_mla_model(tmp_path / "mla")
    with pytest.raises(ModelConfigError, match="--kv-cache-dtype fp8: deepseek_v3's latent attention keeps its cache"):
        make_runner(tmp_path / "mla", kv_cache_dtype="fp8")


@pytest.mark.skipif(cpu_ext.unavailable_reason() is not None, reason="the CPU kernels cannot run here")
def test_the_cpu_decode_kernel_reads_fp8_as_its_dequantized_bfloat16() -> None:
    kernels = cpu_ext.kernels()
    assert kernels is not None, "the CPU kernels failed to build (see the log)"
    num_heads, num_kv_heads, head_dim, page_size = 8, 2, 64, 16
    gen = torch.Generator().manual_seed(1)
    kv_lens = torch.tensor([1, 16, 17, 45, 48])
    num_slots = 16 * 16
    read_pages = torch.randperm(16, generator=gen)[:15].view(5, 3)  # scattered pages, 3 per request
    k, v = (torch.randn(num_slots, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    k[::7] *= 1e-3  # some stored values fall on float8 subnormals (|x| / scale < 2^-6)
    # power-of-two scales: fp8 * scale is exact in bfloat16, so both kernels read the very same numbers
    kv_scales = torch.tensor([2.0**-3, 2.0**-4])
    k8, v8 = quantize_fp8(k, kv_scales[:1]), quantize_fp8(v, kv_scales[1:])
    assert ((k8.float().abs() < 2**-6) & (k8.float() != 0)).any()
    k_deq, v_deq = (dequantize_fp8(x, s, torch.bfloat16) for x, s in ((k8, kv_scales[:1]), (v8, kv_scales[1:])))
    q = (3 * torch.randn(5, num_heads, head_dim, generator=gen)).to(torch.bfloat16)
    out_fp8, out_bf16 = torch.empty_like(q), torch.empty_like(q)
    args = (read_pages, kv_lens, page_size, head_dim**-0.5, 0, 0, torch.empty(0))
    kernels.decode_attention_fp8(q, k8, v8, *args, kv_scales, out_fp8)
    kernels.decode_attention(q, k_deq, v_deq, *args, out_bf16)
    # the same sums in another order: at most a bfloat16 rounding apart
    torch.testing.assert_close(out_fp8.float(), out_bf16.float(), atol=1e-2, rtol=8e-3)
    # and within float8's error of the bfloat16 cache it was quantized from
    out_plain = torch.empty_like(q)
    kernels.decode_attention(q, k.to(torch.bfloat16), v.to(torch.bfloat16), *args, out_plain)
    assert (out_fp8.float() - out_plain.float()).norm() < 0.08 * out_plain.float().norm()


@pytest.mark.parametrize("num_splits", [1, 2])
def test_the_triton_kernels_read_fp8_as_its_dequantized_values(num_splits: int) -> None:
    from loraplex.kernels import paged_attention as pa  # Triton: the interpreter where no GPU is used (conftest)

    gen = torch.Generator().manual_seed(2)
    num_heads, num_kv_heads, head_dim, page_size, num_pages = 4, 2, 16, 16, 12
    k, v = (torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=gen) * 4 for _ in range(2))
    k[::5] *= 1e-3  # float8 subnormals among the stored values
    kv_scales = torch.tensor([0.03, 0.02])
    k8, v8 = quantize_fp8(k, kv_scales[:1]), quantize_fp8(v, kv_scales[1:])
    k_deq, v_deq = (dequantize_fp8(x, s, torch.float32) for x, s in ((k8, kv_scales[:1]), (v8, kv_scales[1:])))
    table = torch.randperm(num_pages, generator=gen)[:10].view(2, 5).to(torch.int32)  # 2 requests, scattered pages
    # decode: one new token per request, after 70 and 33 cached tokens
    q = torch.randn(3, num_heads, head_dim, generator=gen)  # rows 0 and 2 are the requests', row 1 padding
    kv_lens, q_rows = torch.tensor([71, 34], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    outs = [torch.zeros_like(q) for _ in range(2)]
    pa.paged_decode_attention_triton(outs[0], q, k8, v8, table, kv_lens, q_rows, page_size, 0.25, num_splits,
                                     kv_scales=kv_scales)  # fmt: skip
    pa.paged_decode_attention_triton(outs[1], q, k_deq, v_deq, table, kv_lens, q_rows, page_size, 0.25, num_splits)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)
    assert outs[0][[0, 2]].abs().sum() > 0
    # extend: 20 and 9 new tokens after 40 and 0 cached
    q = torch.randn(29, num_heads, head_dim, generator=gen)
    q_starts, q_lens, cached = (torch.tensor(x, dtype=torch.int32) for x in ([0, 20], [20, 9], [40, 0]))
    tile_reqs, tile_offsets = (torch.tensor(x, dtype=torch.int32) for x in pa.plan_extend_tiles([20, 9]))
    outs = [torch.zeros_like(q) for _ in range(2)]
    for out, caches, scales in ((outs[0], (k8, v8), kv_scales), (outs[1], (k_deq, v_deq), None)):
        pa.paged_extend_attention_triton(out, q, *caches, table, q_starts, q_lens, cached, tile_reqs, tile_offsets,
                                         page_size, 0.25, kv_scales=scales)  # fmt: skip
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="k_cache must be torch.float8_e4m3fn"):
        pa.paged_decode_attention_triton(outs[0][:3], q[:3], k_deq, v_deq, table, kv_lens, q_rows, page_size, 0.25, 1,
                                         kv_scales=kv_scales)  # fmt: skip

