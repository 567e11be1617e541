"""The Triton weight-only quantized matmuls (INT4/INT8 in groups, FP8 per block) against their torch references
(tests/kernel_refs.py) over a sweep of sizes, in float32 and float16 (the interpreter on a CPU, compiled on a GPU);
the worker's CUDA layouts through them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loraplex.kernels.mxfp4_matmul import mxfp4_weight_matmul_triton
from loraplex.kernels.quant_matmul import fp8_weight_matmul_triton, int_weight_matmul_triton
from loraplex.worker.quant import mxfp4
from loraplex.worker.quant.matmul import TritonFP8Matmul, TritonIntMatmul
from loraplex.worker.quant.weights import FloatWeight

from tests.device_helpers import TEST_DEVICE
from tests.kernel_refs import fp8_weight_matmul_torch, int_weight_matmul_torch, mxfp4_weight_matmul_torch
from tests.quant_weights import random_int_weight

SIZES = [(1, 64, 64, 32), (7, 96, 128, 64), (33, 200, 256, 128)]  # (tokens, out, in, group size)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3}  # relative to the output's largest magnitude


def close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    return (ours.float() - ref.float()).abs().max().item() <= TOLERANCE[dtype] * ref.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("size", SIZES)
def test_int_weight_matmul(size: tuple[int, int, int, int], bits: int, dtype: torch.dtype) -> None:
    num_tokens, num_rows, num_cols, group_size = size
    gen = torch.Generator().manual_seed(num_rows + bits)
    u = torch.randint(0, 2**bits, (num_rows, num_cols), generator=gen, dtype=torch.uint8)
    q = (u[:, 0::2] | (u[:, 1::2] << 4)) if bits == 4 else u
    num_groups = num_cols // group_size
    scales = torch.rand(num_rows, num_groups, generator=gen) / 50
    zeros = torch.randint(0, 2**bits, (num_rows, num_groups), generator=gen).float()
    x = torch.randn(num_tokens, num_cols, generator=gen).to(dtype)
    args = [t.to(TEST_DEVICE) for t in (x, q.contiguous(), scales, zeros)]
    ours = int_weight_matmul_triton(*args, group_size, bits)
    ref = int_weight_matmul_torch(*args, group_size, bits)
    assert close(ours, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("size", SIZES)
def test_fp8_weight_matmul(size: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    num_tokens, num_rows, num_cols, _ = size
    gen = torch.Generator().manual_seed(num_rows)
    q = (torch.randn(num_rows, num_cols, generator=gen) * 40).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-num_rows // 128), -(-num_cols // 128), generator=gen) / 100
    row_ids, col_ids = torch.arange(num_rows) // 128, torch.arange(num_cols) // 128
    x = torch.randn(num_tokens, num_cols, generator=gen).to(dtype)
    args = [t.to(TEST_DEVICE) for t in (x, q, scales, row_ids, col_ids)]
    assert close(fp8_weight_matmul_triton(*args), fp8_weight_matmul_torch(*args), dtype)


def test_launchers_check_shapes() -> None:
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="scales must be float32"):
        int_weight_matmul_triton(x, torch.zeros(8, 32, dtype=torch.uint8), torch.zeros(8, 3), torch.zeros(8, 3), 32, 4)
    with pytest.raises(ValueError, match="x must be"):
        fp8_weight_matmul_triton(x, torch.zeros(8, 32).to(torch.float8_e4m3fn), torch.zeros(1, 1),
                                 torch.zeros(8, dtype=torch.int64), torch.zeros(32, dtype=torch.int64))


@pytest.mark.parametrize("bits, group_size, act_order", [(4, 32, False), (4, 64, True), (8, 32, True), (8, 128, False)])
def test_cuda_layouts_equal_the_dequantized_weight(bits: int, group_size: int, act_order: bool) -> None:
    # The layouts the worker builds for CUDA (act order permuted into contiguous groups, signed values shifted,
    # INT4 two per byte), run through the kernels: the same product as the dequantized weight.
    for signed in (True, False):
        weight = random_int_weight(bits, group_size, signed, zeros=not signed, act_order=act_order).to(TEST_DEVICE)
        x = torch.randn(5, 128).to(TEST_DEVICE)
        ref = F.linear(x, weight.dequantize(slice(None), torch.float32))
        assert close(TritonIntMatmul(weight, torch.float32)(x), ref, torch.float32)
    q = (torch.randn(200, 300) * 40).to(torch.float8_e4m3fn)
    fp8 = FloatWeight.blocked(q, torch.rand(2, 3) / 100, 128, 128).narrow_rows(30, 150).narrow_cols(100, 150)
    fp8 = fp8.to(TEST_DEVICE)
    x = torch.randn(3, 150).to(TEST_DEVICE)
    ref = F.linear(x, fp8.dequantize(slice(None), torch.float32))
    assert close(TritonFP8Matmul(fp8, torch.float32)(x), ref, torch.float32)


# (tokens, out, in): one token; tails in tokens, rows and the last K tile (in = 3 blocks of 32)
MXFP4_SIZES = [(1, 64, 64), (7, 70, 96)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("size", MXFP4_SIZES)
def test_mxfp4_weight_matmul(size: tuple[int, int, int], dtype: torch.dtype) -> None:
    # every e2m1 code (both nibbles) and exponents around gpt-oss's (2^-8 .. 2^0), into a row range of an output
    num_tokens, num_rows, num_cols = size
    gen = torch.Generator().manual_seed(num_rows)
    blocks = torch.randint(0, 256, (num_rows, num_cols // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(119, 128, (num_rows, num_cols // 32), generator=gen, dtype=torch.uint8)
    x = torch.randn(num_tokens, num_cols, generator=gen).to(dtype)
    out = torch.full((num_tokens + 2, num_rows), 5.0, dtype=dtype)
    ref = mxfp4_weight_matmul_torch(x.float(), blocks, scales).to(dtype)
    x, blocks, scales, out = (t.to(TEST_DEVICE) for t in (x, blocks, scales, out))
    ours = mxfp4_weight_matmul_triton(x, blocks, scales, out=out[1 : num_tokens + 1])
    assert ours.data_ptr() == out[1].data_ptr() and close(ours.cpu(), ref, dtype)
    assert (out[0] == 5.0).all() and (out[-1] == 5.0).all()  # rows outside the range untouched
    assert torch.equal(mxfp4_weight_matmul_triton(x, blocks, scales).cpu(), ours.cpu())


def test_mxfp4_matmul_refuses_partial_blocks_and_wrong_scales() -> None:
    x = torch.randn(2, 48)
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        mxfp4_weight_matmul_triton(x, torch.zeros(4, 24, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="scales must be uint8 \\(4, 2\\)"):
        mxfp4_weight_matmul_triton(x, torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))


def test_mxfp4_kernel_decodes_every_code_and_exponent_exactly() -> None:
    # x = I in float32 (IEEE products): the output is Wᵀ itself, against the CPU path's dequantization
    codes = torch.arange(256, dtype=torch.uint8).view(8, 32)  # every byte: both nibbles take all 16 codes
    blocks = codes.repeat(8, 1)  # (64 rows, 32 bytes) = 64 inputs per row
    # exponents 0 (2^-127, a subnormal) .. 63 and 100 .. 163 (2^36: no product near float32's overflow)
    scales = torch.cat([torch.arange(64), torch.arange(100, 164)]).to(torch.uint8).view(64, 2)
    eye = torch.eye(64)
    ours = mxfp4_weight_matmul_triton(*(t.to(TEST_DEVICE) for t in (eye, blocks, scales))).cpu()
    assert torch.equal(ours, mxfp4.dequantize(blocks, scales, torch.float32).t())
