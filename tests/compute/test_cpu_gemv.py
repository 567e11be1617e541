"""The skinny-matrix kernels (kernels/cpu_gemv.py), each build this CPU runs (AVX-512 BF16, AVX2), against torch's
fp32 matmul on the dequantized weight: bf16, INT8 per channel and per group, INT4 per group (GPTQ/AWQ/compressed-tensors
layouts repacked by worker/quant/avx2.py), 1-32 rows, N and K off the vector width and the block, groups of 32/64/128,
act order, zero points, float32 activations exactly and bfloat16 ones; each layout unpacks to the weight it packed;
above 32 rows the dequantized-tile GEMM. Then workers that take them (forced on, each build) against
the torch path in fp32: logits and greedy tokens of a batch mixing the base and two adapters, quantized and bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loraplex.kernels import cpu_build, cpu_gemv
from loraplex.worker.layers.packed import linear
from loraplex.worker.quant.avx2 import Avx2IntMatmul
from loraplex.worker.quant.weights import IntWeight

from tests.lora_helpers import LORA_CONFIG, batch_logits, greedy_decode, specs
from tests.quantize_checkpoint import write_quantized
from tests.worker_helpers import make_runner, random_prompts

OFF = cpu_gemv.unavailable_reason()
pytestmark = pytest.mark.skipif(OFF is not None, reason=f"AVX2 kernels cannot run here: {OFF}")

ROWS = (1, 2, 7, 32)
SHAPES = [(13, 37), (64, 256), (130, 200), (9, 1031)]  # (out, in): tails, whole blocks, N % 4 != 0, 3 column chunks


@pytest.fixture(params=[cpu_gemv.AVX512, cpu_gemv.AVX2], ids=lambda isa: isa.name)
def build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> cpu_gemv.Isa:
    """Each build of the kernels this CPU runs, taken as if it were the CPU's best."""
    isa = request.param
    reason = cpu_gemv.unavailable_reason(isa)
    if reason is not None:
        pytest.skip(f"the {isa.name} kernels cannot run here: {reason}")
    monkeypatch.setattr(cpu_gemv, "isa", lambda: isa)
    return isa


@pytest.fixture
def forced(build: cpu_gemv.Isa, monkeypatch: pytest.MonkeyPatch) -> cpu_gemv.Isa:
    """The kernels chosen, as on a CPU whose best build is `build`."""
    monkeypatch.setattr(cpu_gemv, "chosen", lambda: True)
    monkeypatch.setattr(cpu_gemv, "chosen_for_int", lambda: True)
    return build


def relative_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_bf16_equals_fp32_matmul(out_features: int, in_features: int, build: cpu_gemv.Isa) -> None:
    # float32 activations exactly (the AVX-512 build splits them into three bfloat16 parts), bfloat16 ones as they are
    gen = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    packed = cpu_gemv.pack_bf16(w)
    assert packed.blocked == (build is cpu_gemv.AVX512) and torch.equal(packed.unpack(slice(None)), w)
    bias = torch.randn(out_features, generator=gen)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=gen)
        assert relative_err(cpu_gemv.gemv(x, packed), x @ w.float().T) < 1e-5, rows  # float32: exact products
        assert relative_err(cpu_gemv.gemv(x, packed, bias), x @ w.float().T + bias) < 1e-5, rows
        xb = x.bfloat16()  # bfloat16 in and out: one rounding of the float32 sums (and bias)
        ours = cpu_gemv.gemv(xb, packed, bias.bfloat16())
        assert ours.dtype == torch.bfloat16 and relative_err(ours, xb.float() @ w.float().T + bias.bfloat16()) < 4e-3
    # past 32 rows: AVX-512 still the kernel (its blocked copy replaced the weight), 3 slabs of rows; AVX2 torch's GEMM
    x = torch.randn(97, in_features, generator=gen).bfloat16()
    weight = w.new_empty(0) if packed.blocked else w
    assert relative_err(linear(x, weight, None, gemv=packed), x.float() @ w.float().T) < 1e-2


def random_int_weight(out_features: int, in_features: int, bits: int, group_size: int, zeros: bool, act_order: bool,
                      seed: int) -> IntWeight:
    """Random values, scales and zero points on the whole range; act order: a shuffled g_idx of whole groups."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-in_features // group_size)
    if zeros:  # unsigned storage with zero points (GPTQ, AWQ, asymmetric compressed-tensors)
        q = torch.randint(0, 1 << bits, (out_features, in_features), generator=gen).to(torch.uint8)
        zero = torch.randint(0, 1 << bits, (out_features, groups), generator=gen, dtype=torch.int32)
    else:  # signed storage around 0 (symmetric compressed-tensors)
        half = 1 << (bits - 1)
        q = torch.randint(-half, half, (out_features, in_features), generator=gen).to(torch.int8)
        zero = None
    scales = torch.rand(out_features, groups, generator=gen) * 0.02 + 0.001
    g_idx = None
    if act_order:
        g_idx = (torch.arange(in_features) // group_size)[torch.randperm(in_features, generator=gen)]
    return IntWeight(q=q, scales=scales, zeros=zero, g_idx=g_idx, group_size=group_size, bits=bits)


CASES = [  # (bits, group_size (None: per channel), zero points, act order, (out, in))
    (8, None, False, False, (13, 37)),
    (8, None, True, False, (130, 200)),
    (8, 32, True, False, (13, 96)),
    (8, 64, False, True, (66, 128)),
    (8, 128, True, False, (64, 256)),
    (4, None, True, False, (13, 37)),
    (4, 32, False, False, (13, 96)),
    (4, 64, True, True, (130, 192)),
    (4, 128, True, False, (66, 256)),
    (8, 96, True, False, (10, 1152)),  # groups straddling the kernel's 512-column chunks
    (4, None, False, False, (9, 1031)),
]


@pytest.mark.parametrize("bits,group_size,zeros,act_order,shape", CASES)
def test_int_equals_fp32_matmul_on_the_dequantized_weight(bits, group_size, zeros, act_order, shape, forced) -> None:
    weight = random_int_weight(*shape, bits, group_size or shape[1], zeros, act_order, seed=bits + shape[0])
    assert Avx2IntMatmul.fits(weight, torch.device("cpu"), torch.float32)
    matmul = Avx2IntMatmul(weight, torch.float32)
    rows = -(-shape[0] // cpu_gemv.BLOCK_ROWS) * cpu_gemv.BLOCK_ROWS  # the blocked layout's whole blocks
    groups = weight.scales.shape[1]
    assert matmul.nbytes <= rows * ((shape[1] + 8) * bits // 8 + 8 * groups) + 8 * shape[1]  # values, scales, order
    reference = weight.dequantize(slice(None), torch.float32)
    gen = torch.Generator().manual_seed(1)
    for rows in (*ROWS, 33, 97):  # the AVX2 build: the dequantized-tile GEMM; AVX-512: the kernel, 3 slabs of rows
        x = torch.randn(rows, shape[1], generator=gen)
        assert relative_err(matmul(x), x @ reference.T) < 1e-5, rows
    for rows in (3, 8):  # bf16 activations: fp32 products (or, from 4 rows on AVX-512, bf16 ones), one rounding
        x = torch.randn(rows, shape[1], generator=gen).bfloat16()
        y = matmul(x)
        assert y.dtype == torch.bfloat16 and relative_err(y, x.float() @ reference.T) < 1e-2
    u = weight.q.to(torch.int16) + weight.signed_offset  # the values, in the checkpoint's column order
    unpacked = matmul.unsigned(slice(None))
    assert torch.equal(unpacked.to(torch.int16), u if matmul.order is None else u[:, matmul.order])
    dequantized = matmul.dequantize(slice(None), torch.float32)  # in the kernel's column order
    for rows in ROWS:  # bfloat16 activations (a bf16 model's): exact products, float32 sums, one rounding
        x = torch.randn(rows, shape[1], generator=gen).bfloat16()
        x = x if matmul.order is None else x[:, matmul.order]
        ours = cpu_gemv.gemv(x, matmul.packed)
        assert ours.dtype == torch.bfloat16 and relative_err(ours, x.float() @ dequantized.T) < 4e-3, rows


def test_fits_only_what_it_streams(forced, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert not Avx2IntMatmul.fits(random_int_weight(8, 100, 4, 20, True, False, 0), cpu, torch.float32)  # 20 % 8
    fits_24 = Avx2IntMatmul.fits(random_int_weight(8, 96, 4, 24, True, False, 0), cpu, torch.float32)
    assert fits_24 == (forced is cpu_gemv.AVX2)  # the AVX-512 build takes groups of 32·i columns
    assert not Avx2IntMatmul.fits(random_int_weight(8, 64, 4, 32, True, False, 0), torch.device("meta"), torch.float32)
    assert Avx2IntMatmul.fits(random_int_weight(8, 64, 4, 32, True, False, 0), cpu, torch.float32)


def test_chosen_wherever_a_build_runs_unless_turned_off(build, monkeypatch: pytest.MonkeyPatch) -> None:
    flags = cpu_build.cpu_flags() - {"amx_bf16"}
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: flags)
    assert cpu_gemv.chosen() and cpu_gemv.chosen_for_int()
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: flags | {"amx_bf16"})  # bf16 stays on oneDNN's AMX GEMM
    assert not cpu_gemv.chosen() and cpu_gemv.chosen_for_int()
    monkeypatch.setenv("LORAPLEX_CPU_GEMV", "on")
    assert cpu_gemv.chosen()
    monkeypatch.setenv("LORAPLEX_CPU_GEMV", "off")
    assert not cpu_gemv.chosen() and not cpu_gemv.chosen_for_int()
    assert not Avx2IntMatmul.fits(random_int_weight(8, 64, 4, 32, True, False, 0), torch.device("cpu"), torch.float32)


def test_bad_shapes_are_refused(build: cpu_gemv.Isa) -> None:
    x = torch.randn(2, 40)
    with pytest.raises(ValueError, match="41"):
        cpu_gemv.gemv(x, cpu_gemv.pack_bf16(torch.zeros(3, 41, dtype=torch.bfloat16)))
    if build is cpu_gemv.AVX2:
        with pytest.raises(ValueError, match="at most 32"):
            cpu_gemv.gemv(torch.randn(33, 40), cpu_gemv.pack_bf16(torch.zeros(3, 40, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="does not fit"):
        cpu_gemv.pack_int(torch.zeros(3, 40, dtype=torch.uint8), torch.ones(3, 2), torch.ones(3, 2), 20, 4)
    with pytest.raises(ValueError, match="scales and biases"):
        cpu_gemv.pack_int(torch.zeros(3, 64, dtype=torch.uint8), torch.ones(3, 1), torch.ones(3, 1), 32, 4)


NAMES = [None, "a4", "a16", None, "a16", "a4"]  # the base and two adapters, mixed
LENGTHS = [5, 9, 3, 6, 4, 2]  # 29 rows: one prefill batch within the kernel's 32 rows


def run_batch(model_dir: Path, adapter_dirs: dict[str, Path], **config) -> tuple[list[torch.Tensor], list, object]:
    """Logits of one mixed prefill batch (29 rows: the kernel's shape) and 4 greedy steps."""
    runner = make_runner(model_dir, **LORA_CONFIG, **config)
    results = runner.lora.load(specs(adapter_dirs, {"a4": 1, "a16": 3}))
    assert all(r.success for r in results)
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=5)
    return batch_logits(runner, prompts, NAMES), greedy_decode(runner, prompts, NAMES, steps=4), runner


@pytest.fixture(scope="module")
def quantized_dirs(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemv-quantized")
    for fmt in ("gptq-4bit-act-order", "ct-w8a16"):
        write_quantized(llama_dir, fmt, root / fmt, root / f"{fmt}-dequantized")
    return {fmt: root / fmt for fmt in ("gptq-4bit-act-order", "ct-w8a16")}


@pytest.mark.parametrize("fmt", ["gptq-4bit-act-order", "ct-w8a16"])
def test_quantized_worker_unchanged_against_the_torch_path(fmt, quantized_dirs, adapter_dirs, build,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_gemv, "chosen_for_int", lambda: False)  # torch's int kernels (LORAPLEX_CPU_GEMV=off)
    torch_logits, torch_tokens, _ = run_batch(quantized_dirs[fmt], adapter_dirs)
    monkeypatch.setattr(cpu_gemv, "chosen_for_int", lambda: True)
    logits, tokens, runner = run_batch(quantized_dirs[fmt], adapter_dirs)
    assert {m.quant.matmul.name for m in runner.model.modules() if getattr(m, "quant", None)} == {Avx2IntMatmul.name}
    for ours, ref in zip(logits, torch_logits, strict=True):
        assert (ours - ref).abs().max().item() < 1e-4
    assert tokens == torch_tokens


def test_bf16_worker_errs_no_more_than_the_torch_path(llama_dir, adapter_dirs, build,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16 activations: against the fp32 run, the kernel (exact products, float32 sums, one rounding) errs no more than
    # torch's bf16 matmul. lora_backend torch: the LoRA path beside the linears stays the same in both bf16 runs.
    oracle, _, _ = run_batch(llama_dir, adapter_dirs)
    monkeypatch.setattr(cpu_gemv, "chosen", lambda: False)  # oneDNN (LORAPLEX_CPU_GEMV=off)
    plain, _, runner = run_batch(llama_dir, adapter_dirs, dtype="bfloat16", lora_backend="torch")
    assert not any(m.gemv for m in runner.model.modules() if hasattr(m, "packed_weight"))
    monkeypatch.setattr(cpu_gemv, "chosen", lambda: True)
    calls = []
    gemv = cpu_gemv.gemv
    monkeypatch.setattr(cpu_gemv, "gemv", lambda x, w, bias=None: calls.append(x.shape[0]) or gemv(x, w, bias))
    ours, _, runner = run_batch(llama_dir, adapter_dirs, dtype="bfloat16", lora_backend="torch")
    linears = [m for m in runner.model.modules() if hasattr(m, "packed_weight") and hasattr(m, "weight")]
    assert all(m.gemv is not None and m.gemv.blocked == (build is cpu_gemv.AVX512) for m in linears)
    assert sum(LENGTHS) in calls and max(calls) <= cpu_gemv.MAX_ROWS
    ours_err = max((a.float() - c).abs().max().item() for a, c in zip(ours, oracle, strict=True))
    plain_err = max((b.float() - c).abs().max().item() for b, c in zip(plain, oracle, strict=True))
    assert ours_err <= 1.5 * plain_err, (ours_err, plain_err)
