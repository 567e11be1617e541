"""The model's fused Triton ops (kernels/rms_norm.py, rotary.py, silu_mul.py) against the torch ops they replace
(tests/kernel_refs.py), over a sweep of small shapes (hidden sizes that are not powers of two, one token and several),
under Triton's interpreter on a CPU (fp32, fp16); the worker's choice of them (CUDA only); a model built on them
against the same model on torch ops; and their compilation for sm_90 and sm_80 (tests/triton_aot.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from loraplex.kernels.rms_norm import add_rms_norm_triton, rms_norm_triton
from loraplex.kernels.rotary import rotary_embedding_triton
from loraplex.kernels.silu_mul import silu_and_mul_triton
from loraplex.worker import model_runner
from loraplex.worker.layers.activation import SiluAndMul
from loraplex.worker.layers.norm import RMSNorm
from loraplex.worker.layers.ops import CPUKernelOps, TorchOps, TritonOps, select_model_ops
from loraplex.worker.layers.rotary import RotaryEmbedding
from loraplex.worker.model.config import RopeConfig

import tests.triton_aot as triton_aot
from tests import kernel_refs
from tests.device_helpers import TEST_DEVICE, USES_GPU  # conftest has set TRITON_INTERPRET where no GPU is used
from tests.worker_helpers import GREEDY, decode, make_runner, prefill_logits, random_prompts

DTYPES = (torch.float32, torch.float16)
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
TOKEN_COUNTS = (1, 3, 17)
ROPES = {
    "default": RopeConfig(10000.0),
    "llama3": RopeConfig(500000.0, "llama3", dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_max_position_embeddings=64)),  # fmt: skip
}


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=TEST_DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [8, 96, 200, 256])
def test_rms_norm_and_residual_add(hidden: int, dtype: torch.dtype) -> None:
    for num_tokens in TOKEN_COUNTS:
        x = _randn(num_tokens, hidden, dtype=dtype, seed=hidden + num_tokens)
        residual = _randn(num_tokens, hidden, dtype=dtype, seed=1000 + hidden)
        weight = 1 + 0.1 * _randn(hidden, dtype=dtype, seed=7)
        x_before, residual_before = x.clone(), residual.clone()
        torch.testing.assert_close(rms_norm_triton(x, weight, 1e-6), kernel_refs.rms_norm_torch(x, weight, 1e-6),
                                   **TOLERANCES[dtype])  # fmt: skip
        out, summed = add_rms_norm_triton(x, residual, weight, 1e-5)
        ref_out, ref_summed = kernel_refs.add_rms_norm_torch(x, residual, weight, 1e-5)
        assert torch.equal(summed, ref_summed)  # one rounding of one addition either way
        torch.testing.assert_close(out, ref_out, **TOLERANCES[dtype])
        assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_reads_strided_rows() -> None:
    wide = _randn(5, 300, dtype=torch.float32, seed=3)
    x, residual = wide[:, :200], wide[:, 100:]  # row stride 300, not the hidden size
    weight = _randn(200, dtype=torch.float32, seed=4)
    out, summed = add_rms_norm_triton(x, residual, weight, 1e-6)
    ref_out, ref_summed = kernel_refs.add_rms_norm_torch(x, residual, weight, 1e-6)
    torch.testing.assert_close(out, ref_out, **TOLERANCES[torch.float32])
    assert torch.equal(summed, ref_summed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "rope"), [
    (4, 2, 16, "default"), (3, 1, 64, "llama3"), (2, 2, 80, "default"), (5, 1, 96, "llama3"),
])  # fmt: skip
def test_rotary_in_place_on_qkv_views(heads: int, kv_heads: int, head_dim: int, rope: str, dtype: torch.dtype) -> None:
    max_positions = 300
    rotary = RotaryEmbedding(head_dim, max_positions, ROPES[rope])  # the model's tables
    cos, sin = rotary.cos.to(TEST_DEVICE), rotary.sin.to(TEST_DEVICE)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    for num_tokens in TOKEN_COUNTS:
        gen = torch.Generator().manual_seed(num_tokens)
        positions = torch.randint(0, max_positions, (num_tokens,), generator=gen).to(TEST_DEVICE)
        qkv = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=num_tokens + head_dim)  # as the model lays out
        ref_qkv = qkv.clone()
        views = [t.view(num_tokens, -1, head_dim) for t in qkv.split([q_size, kv_size, kv_size], dim=-1)]
        ref_views = [t.view(num_tokens, -1, head_dim) for t in ref_qkv.split([q_size, kv_size, kv_size], dim=-1)]
        q, k = rotary_embedding_triton(positions, views[0], views[1], cos, sin)
        kernel_refs.rotary_embedding_torch(positions, ref_views[0], ref_views[1], cos, sin)
        assert q.data_ptr() == views[0].data_ptr() and k.data_ptr() == views[1].data_ptr()  # in place
        torch.testing.assert_close(qkv, ref_qkv, **TOLERANCES[dtype])
        assert torch.equal(views[2], ref_views[2])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [8, 96, 200, 1100])  # 1100: two column blocks, the second ragged
def test_silu_and_mul(intermediate: int, dtype: torch.dtype) -> None:
    for num_tokens in TOKEN_COUNTS:
        gate_up = 3 * _randn(num_tokens, 2 * intermediate, dtype=dtype, seed=intermediate + num_tokens)
        torch.testing.assert_close(silu_and_mul_triton(gate_up), kernel_refs.silu_and_mul_torch(gate_up),
                                   **TOLERANCES[dtype])  # fmt: skip


def test_no_tokens() -> None:
    x = torch.zeros(0, 96, device=TEST_DEVICE)
    assert add_rms_norm_triton(x, x, torch.ones(96, device=TEST_DEVICE), 1e-6)[0].shape == (0, 96)
    assert silu_and_mul_triton(torch.zeros(0, 8, device=TEST_DEVICE)).shape == (0, 4)
    table = torch.zeros(4, 16, device=TEST_DEVICE)
    q = torch.zeros(0, 2, 16, device=TEST_DEVICE)
    assert rotary_embedding_triton(torch.zeros(0, dtype=torch.long, device=TEST_DEVICE), q, q, table, table)[0] is q


@pytest.mark.parametrize("launch", ["triton", "torch"])
def test_launchers_and_references_reject_the_same_arguments(launch: str) -> None:
    ops = dict(triton=(rms_norm_triton, add_rms_norm_triton, rotary_embedding_triton, silu_and_mul_triton),
               torch=(kernel_refs.rms_norm_torch, kernel_refs.add_rms_norm_torch, kernel_refs.rotary_embedding_torch,
                      kernel_refs.silu_and_mul_torch))[launch]  # fmt: skip
    rms_norm, add_rms_norm, rotary, silu_and_mul = ops
    x, weight = torch.zeros(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(6), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight.half(), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, torch.zeros(3, 8), weight, 1e-6)
    with pytest.raises(ValueError, match="x must be"):
        rms_norm(torch.zeros(2, 8, 2)[..., 0], weight, 1e-6)  # strided last dim
    positions, q, table = torch.zeros(2, dtype=torch.long), torch.zeros(2, 2, 16), torch.zeros(4, 16)
    with pytest.raises(ValueError, match="positions"):
        rotary(positions.float(), q, q.clone(), table, table)
    with pytest.raises(ValueError, match="q and k"):
        rotary(positions, q, torch.zeros(2, 1, 8), table, table)
    with pytest.raises(ValueError, match="cos"):
        rotary(positions, q, q.clone(), table.half(), table)
    with pytest.raises(ValueError, match="k must be"):
        rotary(positions, q, torch.zeros(3, 1, 16), table, table)
    with pytest.raises(ValueError, match="gate_up"):
        silu_and_mul(torch.zeros(2, 7))


# ---- the worker's choice: Triton ops on CUDA, never on the CPU ---------------------------------------------------


def test_selection_picks_triton_on_cuda_only() -> None:
    fake_compiled = SimpleNamespace()  # the CPU kernels module, where a CPU worker built it
    assert type(select_model_ops(torch.device("cuda", 1), None)) is TritonOps  # constructs nothing on the device
    assert type(select_model_ops(torch.device("cuda"), fake_compiled)) is TritonOps
    assert type(select_model_ops(torch.device("cpu"), None)) is TorchOps
    cpu_ops = select_model_ops(torch.device("cpu"), fake_compiled)
    assert type(cpu_ops) is CPUKernelOps and cpu_ops.compiled is fake_compiled


def test_cpu_worker_never_holds_triton_ops(llama_dir: Path) -> None:
    runner = make_runner(llama_dir)
    holders = [m for m in runner.model.modules() if isinstance(m, RMSNorm | SiluAndMul | RotaryEmbedding)]
    assert len(holders) == 3 * runner.model_config.num_layers + 2  # + the final norm and the one shared rotary
    assert all(type(m.ops) is TorchOps for m in holders)


@pytest.mark.skipif(USES_GPU, reason="the worker helpers build CPU models: Triton runs them only in its interpreter")
def test_model_on_triton_ops_matches_torch_ops(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The wiring: residual stream carried through the fused norms, q and k rotated in place inside the qkv output.
    prompt = [5, 17, 3, 99, 42, 7, 64]
    torch_runner = make_runner(llama_dir)
    expected = prefill_logits(torch_runner, prompt)
    monkeypatch.setattr(model_runner, "select_model_ops", lambda device, cpu_kernels: TritonOps())
    runner = make_runner(llama_dir)
    assert all(type(m.ops) is TritonOps for m in runner.model.modules() if isinstance(m, RMSNorm | RotaryEmbedding))
    torch.testing.assert_close(prefill_logits(runner, prompt), expected, atol=1e-4, rtol=1e-4)
    # paged decoding: positions past the prompt, a batch of two
    prompts = random_prompts([5, 9], runner.vocab_size, seed=3)
    assert decode(runner, prompts, [GREEDY] * 2, steps=4) == decode(torch_runner, prompts, [GREEDY] * 2, steps=4)


# ---- ahead of time, for the GPUs -----------------------------------------------------------------------------------


def test_every_variant_compiles_for_sm90_and_sm80() -> None:
    # In a child without the interpreter: the start-up warm-up's launches (TritonOps.warmup) for each model shape and
    # dtype compiled through ptxas for each target, and a sweep of real batches meets no variant the warm-up did not.
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "triton_aot.py"), "model-ops"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert len(results) == 2 * len(triton_aot.MODEL_OPS_CONFIGS)
    for result in results:
        where = f"sm_{result['arch']} {result['dtype']} {result['shape']}"
        # rms_norm and add_rms_norm are one kernel's two variants
        assert len(result["compiled"]) == triton_aot.MODEL_OPS_KERNELS, where
        assert sorted(result["serving_keys"]) == result["warmup_keys"], where
        assert all(c["arch"] == result["arch"] for c in result["compiled"]), where


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rotary_on_triton_ops_matches_torch_ops(dtype: torch.dtype) -> None:
    # Phi-4-mini's form: the kernel rotates the leading 3/4 of each head in place, through strided views.
    rope = RopeConfig(10000.0, partial_rotary_factor=0.75)
    ours, ref = RotaryEmbedding(32, 64, rope), RotaryEmbedding(32, 64, rope)
    ours.ops, ref.ops = TritonOps(), TorchOps()
    ours.cos, ours.sin = ours.cos.to(TEST_DEVICE), ours.sin.to(TEST_DEVICE)
    positions = torch.tensor([0, 5, 63, 17], device=TEST_DEVICE)
    q, k = _randn(4, 3, 32, dtype=dtype, seed=1), _randn(4, 1, 32, dtype=dtype, seed=2)
    got_q, got_k = ours(positions, q.clone(), k.clone())
    want_q, want_k = ref(positions.cpu(), q.cpu(), k.cpu())
    torch.testing.assert_close(got_q.cpu(), want_q, **TOLERANCES[dtype])
    torch.testing.assert_close(got_k.cpu(), want_k, **TOLERANCES[dtype])
    assert torch.equal(got_q[..., 24:], q[..., 24:])  # the pass-through features untouched
