"""Quantization pieces on plain tensors: which method a checkpoint is served with, the documented GPTQ/AWQ bit
orders, TP shards that would split a group, and each CPU kernel against the dequantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loraplex.protocol.config import ConfigError
from loraplex.protocol.quantization import resolve_quantization
from loraplex.worker.layers.linear import RowParallelLinear
from loraplex.worker.parallel import tensor_parallel
from loraplex.worker.quant.formats import GPTQFormat
from loraplex.worker.quant.layer import quantized_linears
from loraplex.worker.quant.matmul import (
    INT8_GEMM_MIN_TOKENS,
    DequantTileMatmul,
    Int4GroupMatmul,
    Int8ChannelMatmul,
    build_matmul,
)
from loraplex.worker.quant.packing import AWQ_ORDER, pack_int32, unpack_int32
from loraplex.worker.quant.weights import FloatWeight

from tests.quant_weights import random_int_weight

GPTQ = {"quantization_config": {"quant_method": "gptq", "bits": 4}}


def test_method_follows_the_checkpoint() -> None:
    assert resolve_quantization("auto", {}) is None
    assert resolve_quantization("none", {}) is None
    assert resolve_quantization("auto", GPTQ) == "gptq"
    assert resolve_quantization("gptq", GPTQ) == "gptq"
    for flag, says in (("awq", "quantized with gptq"), ("none", "quantized with gptq")):
        with pytest.raises(ConfigError, match=says):
            resolve_quantization(flag, GPTQ)
    with pytest.raises(ConfigError, match="no quantization_config"):
        resolve_quantization("fp8", {})
    for flag in ("auto", "none", "fp8"):  # a method we do not serve never starts, whatever the flag
        with pytest.raises(ConfigError, match="'bitsandbytes'"):
            resolve_quantization(flag, {"quantization_config": {"quant_method": "bitsandbytes"}})


def test_documented_bit_orders() -> None:
    values = torch.arange(1, 9, dtype=torch.uint8)
    # GPTQ: element j of a word in bits [4j, 4j + 4)
    assert pack_int32(values.view(8, 1), 4, dim=0).item() == 0x87654321 - 2**32
    # AWQ: nibble j holds element AWQ_ORDER[j] of the 8
    assert pack_int32(torch.arange(8).view(1, 8), 4, dim=1, order=AWQ_ORDER).item() == 0x75316420
    for bits, order in ((4, None), (8, None), (4, AWQ_ORDER)):
        v = torch.randint(0, 2**bits, (16, 32), dtype=torch.uint8)
        for dim in (0, 1):
            assert torch.equal(unpack_int32(pack_int32(v, bits, dim, order), bits, dim, order), v)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("num_tokens", [5, INT8_GEMM_MIN_TOKENS])  # both sides of the INT8 kernel's switch
def test_cpu_kernels_equal_the_dequantized_weight(signed: bool, zeros: bool, num_tokens: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_CPU_GEMV", "off")  # torch's kernels (the skinny-matrix ones: test_cpu_gemv.py)
    x = torch.randn(num_tokens, 128)
    cases = [
        (random_int_weight(8, 128, signed, zeros, False), Int8ChannelMatmul),
        (random_int_weight(4, 32, signed, zeros, False), Int4GroupMatmul),
        (random_int_weight(4, 64, signed, zeros, True), Int4GroupMatmul),  # act order permuted into place
        (random_int_weight(8, 32, signed, zeros, True), DequantTileMatmul),
    ]
    for weight, kernel in cases:
        matmul = build_matmul(weight, torch.device("cpu"), torch.float32)
        assert isinstance(matmul, kernel)
        ref = F.linear(x, weight.dequantize(slice(None), torch.float32))
        assert (matmul(x) - ref).abs().max().item() < 1e-4 * ref.abs().max().item(), kernel.name


def test_tp_shards_keep_whole_groups() -> None:
    weight = random_int_weight(4, 32, True, True, False)
    shard = weight.narrow_cols(64, 64)
    assert torch.equal(shard.dequantize(slice(None), torch.float32),
                       weight.dequantize(slice(None), torch.float32)[:, 64:])
    with pytest.raises(ValueError, match="splits a quantization group of 32"):
        weight.narrow_cols(48, 48)
    act_order = random_int_weight(4, 32, True, True, True)  # scattered groups: any column range keeps its scales
    assert torch.equal(act_order.narrow_cols(48, 48).dequantize(slice(None), torch.float32),
                       act_order.dequantize(slice(None), torch.float32)[:, 48:96])


def test_fp8_blocks_shard_and_fuse_anywhere() -> None:
    q = (torch.randn(200, 300) * 50).to(torch.float8_e4m3fn)
    weight = FloatWeight.blocked(q, torch.rand(2, 3), 128, 128)
    full = weight.dequantize(slice(None), torch.float32)
    shard = weight.narrow_rows(100, 60).narrow_cols(150, 100)  # inside blocks on both sides
    assert torch.equal(shard.dequantize(slice(None), torch.float32), full[100:160, 150:250])
    fused = FloatWeight.cat_rows([weight.narrow_rows(0, 70), weight.narrow_rows(70, 130)])
    assert torch.equal(fused.dequantize(slice(None), torch.float32), full)
    tiles = DequantTileMatmul(weight, torch.float32)
    x = torch.randn(3, 300)
    assert torch.allclose(tiles(x), F.linear(x, full), atol=1e-3)


def test_a_tp_rank_that_would_split_a_group_is_refused_at_load() -> None:
    # 192 input columns in GPTQ groups of 64: two ranks of 96 columns each, rank 1's starting inside group 1
    fmt = GPTQFormat({"bits": 4, "group_size": 64, "desc_act": False, "sym": True})
    with tensor_parallel(1, 2), quantized_linears(fmt):
        layer = RowParallelLinear(192, 16)
    tensors = {"qweight": torch.zeros(24, 16, dtype=torch.int32), "qzeros": torch.zeros(3, 2, dtype=torch.int32),
               "scales": torch.ones(3, 16, dtype=torch.float16),
               "g_idx": (torch.arange(192) // 64).to(torch.int32)}
    with pytest.raises(ValueError, match="splits a quantization group of 64"):
        for name, tensor in tensors.items():
            param = getattr(layer, name)
            param.weight_loader(param, tensor)
