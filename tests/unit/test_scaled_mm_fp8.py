"""W8A8 FP8 through torch._scaled_mm (worker/quant/scaled_mm.py): which FP8 weights take it (CUDA faked with a
compute capability), the activations' FP8 quantization, the call's arguments against CUDA's layout rules, and its
numerics on the CPU (torch's CPU build implements _scaled_mm, row-wise and tensor-wise) against the checkpoint's
weights dequantized by its own library."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loraplex.worker.quant.formats import FP8Format, build_format
from loraplex.worker.quant.matmul import DequantTileMatmul, TritonFP8Matmul, TritonIntMatmul, choose_matmul
from loraplex.worker.quant.scaled_mm import FP8_MAX, ScaledMMFP8Matmul, quantize_activations
from loraplex.worker.quant.weights import FloatWeight

from tests.quant_weights import random_int_weight
from tests.quantize_checkpoint import _quantize

CUDA = torch.device("cuda")
E4M3_REL = 2.0**-4  # e4m3's relative rounding error bound (3 mantissa bits), normal range


def fp8_checkpoint_weight(fmt: str, num_rows: int = 96, num_cols: int = 256, seed: int = 0):
    """(the FloatWeight loraplex decodes from a one-linear checkpoint in `fmt`, the weight its library dequantizes)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(num_rows, num_cols, generator=gen) * 0.02 * torch.linspace(0.5, 3.0, num_rows)[:, None]
    if fmt == "fp8-tensor":  # vLLM's fp8 method per tensor (tests/quantize_checkpoint.py writes blocks only)
        scale = w.abs().amax() / FP8_MAX
        q = (w / scale).to(torch.float8_e4m3fn)
        weight = FP8Format({"activation_scheme": "dynamic"}).decode({"weight": q, "weight_scale": scale.reshape(1)},
                                                                     num_rows, num_cols)  # fmt: skip
        return weight, q.float() * scale
    tensors, dequant, config = _quantize(fmt, w, torch.arange(num_cols), 128)
    method = config.get("quant_method", "compressed-tensors")
    return build_format(method, config).decode(tensors, num_rows, num_cols), dequant


@pytest.fixture
def capability(monkeypatch: pytest.MonkeyPatch):
    """Fakes torch.cuda's answer for the device's compute capability."""

    def set_capability(major: int, minor: int) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))

    return set_capability


def test_selection_on_cuda_by_capability_scales_and_dtype(capability) -> None:
    channel, _ = fp8_checkpoint_weight("ct-fp8-channel")  # W8A8, per-token activations
    tensor, _ = fp8_checkpoint_weight("ct-fp8-tensor")  # W8A8, static input scale
    vllm_tensor, _ = fp8_checkpoint_weight("fp8-tensor")
    ct_block, _ = fp8_checkpoint_weight("ct-fp8-block")  # weight-only
    vllm_block, _ = fp8_checkpoint_weight("fp8-block")  # W8A8 with block scales
    assert (channel.w8a8, tensor.w8a8, vllm_tensor.w8a8, ct_block.w8a8, vllm_block.w8a8) == (True,) * 3 + (False, True)
    for major, minor in ((9, 0), (8, 9), (10, 0)):
        capability(major, minor)
        for weight in (channel, tensor, vllm_tensor):
            for dtype in (torch.bfloat16, torch.float16):
                assert choose_matmul(weight, CUDA, dtype) is ScaledMMFP8Matmul, (major, minor, dtype)
            assert choose_matmul(weight, CUDA, torch.float32) is TritonFP8Matmul  # the exact-to-HF dtype
        for weight in (ct_block, vllm_block):  # weight-only, or scales that change along the input
            assert choose_matmul(weight, CUDA, torch.bfloat16) is TritonFP8Matmul
        odd = fp8_checkpoint_weight("ct-fp8-channel", num_rows=40)[0]  # _scaled_mm wants dims of multiples of 16
        assert choose_matmul(odd, CUDA, torch.bfloat16) is TritonFP8Matmul
        assert choose_matmul(random_int_weight(4, 32, True, True, False), CUDA, torch.bfloat16) is TritonIntMatmul
    capability(8, 0)  # A100: no FP8 tensor cores
    assert choose_matmul(channel, CUDA, torch.bfloat16) is TritonFP8Matmul
    assert choose_matmul(channel, torch.device("cpu"), torch.bfloat16) is DequantTileMatmul


def test_shards_and_fused_projections_keep_row_scales(capability) -> None:
    capability(9, 0)
    tensor, _ = fp8_checkpoint_weight("ct-fp8-tensor")
    other, _ = fp8_checkpoint_weight("ct-fp8-tensor", seed=1)
    fused = FloatWeight.cat_rows([tensor, other])  # two per-tensor scales: one per row now
    assert fused.w8a8 and choose_matmul(fused, CUDA, torch.bfloat16) is ScaledMMFP8Matmul
    assert not ScaledMMFP8Matmul(fused, torch.bfloat16).per_tensor
    assert ScaledMMFP8Matmul(tensor, torch.bfloat16).per_tensor
    shard = fused.narrow_rows(32, 96).narrow_cols(128, 128)  # a TP shard of each kind
    assert choose_matmul(shard, CUDA, torch.bfloat16) is ScaledMMFP8Matmul
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    ref = F.linear(x.float(), shard.dequantize(slice(None), torch.float32))
    assert (ScaledMMFP8Matmul(shard, torch.bfloat16)(x).float() - ref).abs().max() <= 0.05 * ref.abs().max()


@pytest.mark.parametrize("per_token", [True, False])
def test_activation_quantization(per_token: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen) * torch.tensor([1.0, 30.0, 0.5, 2.0, 1.0])[:, None]
    x[3] = 0  # an all-zero token
    x_q, scale = quantize_activations(x.to(torch.bfloat16), per_token)
    assert x_q.dtype == torch.float8_e4m3fn and x_q.is_contiguous() and x_q.shape == x.shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == ((5, 1) if per_token else ())
    assert (scale > 0).all()
    restored = x_q.float() * scale
    x_bf16 = x.to(torch.bfloat16).float()
    amax = x_bf16.abs().amax(-1, keepdim=True) if per_token else x_bf16.abs().amax()
    assert torch.equal(restored.abs().amax(-1, keepdim=True) if per_token else restored.abs().amax(), amax)
    normal = x_bf16.abs() >= 2.0**-6 * scale  # above e4m3's subnormals: relative rounding at most 2^-4
    assert ((restored - x_bf16).abs() <= E4M3_REL * x_bf16.abs())[normal].all()
    assert torch.equal(restored[3], torch.zeros(64))


def _cuda_rules_stand_in(calls: list[dict]):
    """torch._scaled_mm with CUDA's argument rules asserted, then the CPU's own run."""
    real = torch._scaled_mm

    def scaled_mm(a, b, scale_a, scale_b, out_dtype=None, **kwargs):
        assert a.dtype == b.dtype == torch.float8_e4m3fn
        assert a.stride() == (a.shape[1], 1), "the first operand must be row-major"
        assert b.stride() == (1, b.shape[0]), "the second operand must be column-major"
        assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0
        assert scale_a.dtype == scale_b.dtype == torch.float32
        if scale_a.numel() == 1 and scale_b.numel() == 1:
            kind = "tensor-wise"
        else:
            assert tuple(scale_a.shape) == (a.shape[0], 1) and tuple(scale_b.shape) == (1, b.shape[1])
            assert scale_a.is_contiguous() and scale_b.is_contiguous()
            assert out_dtype == torch.bfloat16, "row-wise scaling writes bfloat16 only"
            kind = "row-wise"
        calls.append({"kind": kind, "out_dtype": out_dtype})
        return real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, **kwargs)

    return scaled_mm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt, kind", [("ct-fp8-channel", "row-wise"), ("ct-fp8-tensor", "tensor-wise"),
                                       ("fp8-tensor", "tensor-wise")])
def test_scaled_mm_matches_the_dequantized_checkpoint(fmt: str, kind: str, dtype: torch.dtype,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    weight, dequant = fp8_checkpoint_weight(fmt)
    assert torch.equal(weight.dequantize(slice(None), torch.float32), dequant.float())
    calls: list[dict] = []
    monkeypatch.setattr(torch, "_scaled_mm", _cuda_rules_stand_in(calls))
    matmul = ScaledMMFP8Matmul(weight, dtype)
    gen = torch.Generator().manual_seed(1)
    spread = [1.0, 4.0, 0.25, 1.0, 2.0, 1.0, 0.5] if kind == "tensor-wise" else [1.0, 100.0, 0.01, 1, 1, 1, 1]
    x = (torch.randn(7, weight.shape[1], generator=gen) * torch.tensor(spread)[:, None]).to(dtype)
    y = matmul(x)
    assert y.dtype == dtype and y.shape == (7, weight.shape[0])
    assert calls == [{"kind": kind, "out_dtype": torch.bfloat16 if kind == "row-wise" else dtype}]
    # Exactly what it computes: the activations as quantized, times the weight, rounded once to the output dtype.
    x_q, x_scale = quantize_activations(x, per_token=kind == "row-wise")
    emulated = F.linear(x_q.float() * x_scale, dequant.float())
    assert (y.float() - emulated).abs().max() <= 8e-3 * emulated.abs().max()
    # Against the unquantized activations: each token within FP8's rounding (an outlier token, per-token scaled,
    # costs the others nothing).
    ref = F.linear(x.float(), dequant.float())
    row_err = (y.float() - ref).abs().amax(-1) / ref.abs().amax(-1)
    assert (row_err <= 0.05).all(), row_err
    assert matmul(x[:0]).shape == (0, weight.shape[0])
