"""Gated DeltaNet's Triton kernels (kernels/gated_delta.py) against the torch mixer they replace (tests/kernel_refs.py:
the chunked and recurrent forms of worker/layers/gated_delta.py), under Triton's interpreter on a CPU (fp32, fp16):
several requests of different lengths in one launch (one token, fewer tokens than the conv's state, across the conv's
token tiles and the chunked form's chunk boundary), grouped key heads, states read from and written back to
scattered slots in float32 or the activations' dtype, inputs as the layer's column views; the hybrid models on the
kernels against the same models on torch ops; and the kernels' compilation for sm_90 and sm_80 (tests/triton_aot.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loraplex.kernels import gated_delta as gd
from loraplex.protocol.structs import ForwardReq
from loraplex.worker import model_runner
from loraplex.worker.layers.delta_mixer import TorchDeltaMixer, TritonDeltaMixer, select_delta_mixer
from loraplex.worker.layers.ops import TorchOps, TritonOps
from loraplex.worker.model.qwen3_5 import GatedDeltaNet

import tests.triton_aot as triton_aot
from tests import kernel_refs
from tests.device_helpers import TEST_DEVICE, USES_GPU  # conftest has set TRITON_INTERPRET where no GPU is used
from tests.hybrid_models import build_hybrid_model
from tests.worker_helpers import GREEDY, consecutive_pages, make_runner, random_prompts

LENGTHS = [5, 1, 66, 2, 18]  # a decode among prefills; fewer tokens than the conv state; 66 > one chunk (64)
SLOTS = [6, 0, 3, 9, 4]  # of NUM_SLOTS, not in order; the others must come back untouched
NUM_SLOTS = 10
FP32_TOL = 3e-4  # logits of the random hybrid models, magnitude ~10 through four layers
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _table(lengths: list[int], slots: list[int]) -> torch.Tensor:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return torch.tensor([starts, lengths, slots], dtype=torch.int32, device=TEST_DEVICE)


def _randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device=TEST_DEVICE, dtype=dtype)


# ---- the conv -------------------------------------------------------------------------------------------------------


def _conv_inputs(num_tokens: int, dtype: torch.dtype, state_dtype: torch.dtype, channels: int = 150, kernel: int = 4,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    # x: the conv's columns of a wider projection output (Qwen3-Next's q | k | v beside z); 150 channels: 2 blocks
    x = _randn(num_tokens, channels + 24, gen=gen, dtype=dtype)[:, :channels]
    conv_states = _randn(NUM_SLOTS, channels, kernel - 1, gen=gen, dtype=state_dtype)
    weight = _randn(channels, 1, kernel, gen=gen, dtype=dtype, scale=0.5)[:, 0]  # as the layer slices conv1d.weight
    return x, conv_states, weight


CONV_DTYPES = [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32)]


@pytest.mark.parametrize(("dtype", "state_dtype"), CONV_DTYPES)
def test_conv_over_requests_matches_torch(dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    x, states, weight = _conv_inputs(sum(LENGTHS), dtype, state_dtype)
    expected_states = states.clone()
    table = _table(LENGTHS, SLOTS)
    out = gd.causal_conv_triton(x, states, weight, table)
    expected = kernel_refs.causal_conv_torch(x, expected_states, weight, table)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    torch.testing.assert_close(states, expected_states, atol=0, rtol=0)  # copies of inputs: exact, others untouched


@pytest.mark.parametrize(("dtype", "state_dtype"), CONV_DTYPES)
def test_conv_decode_matches_torch(dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    x, states, weight = _conv_inputs(4, dtype, state_dtype, seed=1)
    expected_states = states.clone()
    slots = torch.tensor([7, 2, 5, 0], device=TEST_DEVICE)
    out = gd.causal_conv_decode_triton(x, states, weight, slots)
    expected = kernel_refs.causal_conv_decode_torch(x, expected_states, weight, slots)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    torch.testing.assert_close(states, expected_states, atol=0, rtol=0)


# ---- the delta rule -------------------------------------------------------------------------------------------------


def _rule_inputs(num_tokens: int, key_heads: int, value_heads: int, dtype: torch.dtype, state_dtype: torch.dtype,
                 dv: int = 24, dk: int = 16, seed: int = 0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """q, k, v as the layer's views of one conv output row (tokens, q | k | v); g, beta; states."""
    gen = torch.Generator().manual_seed(seed)
    q_size = key_heads * dk
    conv_out = _randn(num_tokens, 2 * q_size + value_heads * dv, gen=gen, dtype=dtype)
    q, k, v = conv_out.split([q_size, q_size, value_heads * dv], dim=-1)
    g = -torch.rand(num_tokens, value_heads, generator=gen).to(TEST_DEVICE)  # decays in (1/e, 1]
    beta = torch.rand(num_tokens, value_heads, generator=gen).to(device=TEST_DEVICE, dtype=dtype)
    states = _randn(NUM_SLOTS, value_heads, dk, dv, gen=gen, dtype=state_dtype, scale=0.3)
    return (q.view(num_tokens, key_heads, dk), k.view(num_tokens, key_heads, dk), v.view(num_tokens, value_heads, dv),
            g, beta, states)  # fmt: skip


RULE_CASES = [  # (key heads, value heads, dtype, state dtype, dv: 24 one ragged block of columns, 40 two)
    (2, 4, torch.float32, torch.float32, 40),  # two value heads per key head
    (1, 3, torch.float32, torch.float32, 24),  # one key head for all
    (2, 2, torch.float32, torch.float32, 24),  # no grouping
    (2, 4, torch.float16, torch.float32, 24),
    (2, 4, torch.float16, torch.float16, 24),  # the state in the activations' dtype, rounded once per pass
]


@pytest.mark.parametrize(("key_heads", "value_heads", "dtype", "state_dtype", "dv"), RULE_CASES)
def test_rule_over_requests_matches_chunked_torch(key_heads: int, value_heads: int, dtype: torch.dtype,
                                                  state_dtype: torch.dtype, dv: int) -> None:  # fmt: skip
    q, k, v, g, beta, states = _rule_inputs(sum(LENGTHS), key_heads, value_heads, dtype, state_dtype, dv)
    expected_states = states.clone()
    table = _table(LENGTHS, SLOTS)
    out = gd.delta_rule_triton(q, k, v, g, beta, states, table)
    expected = kernel_refs.delta_rule_torch(q, k, v, g, beta, expected_states, table)
    assert out.dtype == torch.float32 and out.shape == v.shape
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)  # both in float32 from the same inputs
    torch.testing.assert_close(states, expected_states, **TOLERANCES[state_dtype])
    untouched = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert torch.equal(states[untouched], expected_states[untouched])


@pytest.mark.parametrize(("dtype", "state_dtype"), [(torch.float32, torch.float32), (torch.float16, torch.float16)])
def test_rule_decode_matches_recurrent_torch(dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    q, k, v, g, beta, states = _rule_inputs(3, 2, 4, dtype, state_dtype, seed=2)
    expected_states = states.clone()
    slots = torch.tensor([8, 1, 5], device=TEST_DEVICE)
    out = gd.delta_rule_decode_triton(q, k, v, g, beta, states, slots)
    expected = kernel_refs.delta_rule_decode_torch(q, k, v, g, beta, expected_states, slots)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(states, expected_states, **TOLERANCES[state_dtype])


def test_a_prefill_in_two_passes_equals_one() -> None:
    # The state written back at the end of a pass is the state the next pass starts from (chunked prefill).
    q, k, v, g, beta, states = _rule_inputs(40, 2, 4, torch.float32, torch.float32, seed=3)
    two = states.clone()
    whole = gd.delta_rule_triton(q, k, v, g, beta, states, _table([40], [2]))
    first = gd.delta_rule_triton(q[:25], k[:25], v[:25], g[:25], beta[:25], two, _table([25], [2]))
    second = gd.delta_rule_triton(q[25:], k[25:], v[25:], g[25:], beta[25:], two, _table([15], [2]))
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(two, states, atol=1e-5, rtol=1e-5)


def test_launchers_check_their_arguments() -> None:
    q, k, v, g, beta, states = _rule_inputs(5, 2, 4, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="request table"):
        gd.delta_rule_triton(q, k, v, g, beta, states, _table([5], [0]).long())
    with pytest.raises(ValueError, match="slots"):
        gd.delta_rule_decode_triton(q, k, v, g, beta, states, torch.tensor([0, 1], device=TEST_DEVICE))
    with pytest.raises(ValueError, match="key_heads dividing"):
        gd.delta_rule_triton(q[:, :, :8].contiguous(), k, v, g, beta, states, _table([5], [0]))
    x, conv_states, weight = _conv_inputs(5, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="must match"):
        gd.causal_conv_triton(x, conv_states[:, :, :2], weight, _table([5], [0]))


# ---- in the model ---------------------------------------------------------------------------------------------------


def test_layers_take_triton_beside_triton_ops_only() -> None:
    assert type(select_delta_mixer(TritonOps())) is TritonDeltaMixer
    assert type(select_delta_mixer(TorchOps())) is TorchDeltaMixer


@pytest.mark.skipif(USES_GPU, reason="the worker helpers build CPU models: Triton runs them only in its interpreter")
def test_hybrid_model_on_the_kernels_matches_torch_ops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The wiring: prompts of mixed lengths in one pass (the varlen launches), then a pass of decodes only (the
    # one-token launches), in scattered slots. Qwen3-Next (Qwen3.5's layer, MoE MLPs): its conv input is a column
    # view of its fused projection.
    build_hybrid_model(tmp_path, arch="qwen3_next")
    torch_runner = make_runner(tmp_path, max_running_requests=8)
    monkeypatch.setattr(model_runner, "select_model_ops", lambda device, cpu_kernels: TritonOps())
    runner = make_runner(tmp_path, max_running_requests=8)
    mixers = [m.mixer for m in runner.model.modules() if isinstance(m, GatedDeltaNet)]
    assert len(mixers) == 3 and all(type(m) is TritonDeltaMixer for m in mixers)
    lengths, slots = [5, 1, 70, 12], [7, 2, 0, 5]
    prompts = random_prompts(lengths, runner.vocab_size, seed=4)
    pages = consecutive_pages([n + 1 for n in lengths], runner.page_size)
    prefill = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, state_slot=s)
               for p, pg, s in zip(prompts, pages, slots, strict=True)]  # fmt: skip
    decode = [ForwardReq(input_ids=[(3 * i + 1) % runner.vocab_size], num_cached_tokens=n, page_ids=pg,
                         sampling=GREEDY, state_slot=s)
              for i, (n, pg, s) in enumerate(zip(lengths, pages, slots, strict=True))]  # fmt: skip
    for reqs in (prefill, decode):
        with torch.inference_mode():
            expected = torch_runner.logits(reqs, [], last_only=False)
            logits = runner.logits(reqs, [], last_only=False)
        # the recurrent form rounds unlike the chunked one (~1e-7 a layer); the random MoE model amplifies it, as
        # test_hybrid_worker.py's FP32_TOL allows against HF
        torch.testing.assert_close(logits, expected, atol=FP32_TOL, rtol=FP32_TOL)
    # the later layers' states hold inputs that went through the earlier layers: as close as the logits
    torch.testing.assert_close(runner.kv_cache.recurrent, torch_runner.kv_cache.recurrent, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(runner.kv_cache.conv, torch_runner.kv_cache.conv, atol=1e-4, rtol=1e-4)



@pytest.mark.skipif(USES_GPU, reason="the worker helpers build CPU models: Triton runs them only in its interpreter")
def test_snapshot_saves_and_restores_on_the_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A pass saving snapshots runs in rounds (worker/state_cache.py): round r the r-th piece of every request, on the
    # varlen launches even where a piece is one token. Two saves inside one prompt (one past the chunk boundary),
    # one at a prompt's end, a request saving nothing beside them: the pass equals the same pass saving nothing, on
    # the kernels; the snapshots equal the torch ops'; a request restoring one equals its prompt computed whole.
    build_hybrid_model(tmp_path, arch="qwen3_next")
    torch_runner = make_runner(tmp_path, max_running_requests=8, max_state_snapshots=4)
    monkeypatch.setattr(model_runner, "select_model_ops", lambda device, cpu_kernels: TritonOps())
    runner, plain = (make_runner(tmp_path, max_running_requests=8, max_state_snapshots=4) for _ in range(2))
    lengths, slots = [9, 70, 12], [3, 0, 5]
    prompts = random_prompts(lengths, runner.vocab_size, seed=8)
    pages = consecutive_pages(lengths, runner.page_size)

    def reqs(saves: list[list[tuple[int, int]]]) -> list[ForwardReq]:
        return [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, state_slot=s,
                           snapshot_saves=sv)
                for p, pg, s, sv in zip(prompts, pages, slots, saves, strict=True)]  # fmt: skip

    with torch.inference_mode():
        saving = runner.logits(reqs([[(9, 2)], [(8, 0), (68, 1)], []]), [], last_only=False)
        torch_runner.logits(reqs([[(9, 2)], [(8, 0), (68, 1)], []]), [], last_only=False)
        torch.testing.assert_close(saving, plain.logits(reqs([[], [], []]), [], last_only=False), atol=1e-5, rtol=1e-5)
    for name in ("recurrent", "conv"):
        torch.testing.assert_close(getattr(runner.kv_cache, name), getattr(plain.kv_cache, name))
    cache, reference = runner.kv_cache, torch_runner.kv_cache
    assert cache.recurrent_snapshots[:, :3].abs().sum(dim=(2, 3, 4)).min() > 0  # all three saved
    torch.testing.assert_close(cache.recurrent_snapshots, reference.recurrent_snapshots, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache.conv_snapshots, reference.conv_snapshots, atol=1e-4, rtol=1e-4)
    whole = prompts[1][:68] + random_prompts([7], runner.vocab_size, seed=9)[0]
    table = consecutive_pages([75], runner.page_size, first=40)[0]
    resumed = ForwardReq(input_ids=whole[68:], num_cached_tokens=68, page_ids=pages[1][:17] + table[17:],
                         sampling=GREEDY, state_slot=6, restore_snapshot=1)  # fmt: skip
    recomputed = ForwardReq(input_ids=whole, num_cached_tokens=0, page_ids=table, sampling=GREEDY, state_slot=7)
    with torch.inference_mode():
        torch.testing.assert_close(runner.logits([resumed], [], last_only=False),
                                   plain.logits([recomputed], [], last_only=False)[68:], atol=1e-4, rtol=1e-4)


# ---- ahead of time, for the GPUs -----------------------------------------------------------------------------------


def test_every_variant_compiles_for_sm90_and_sm80() -> None:
    # In a child without the interpreter (tests/triton_aot.py gated-delta): the start-up warm-up's launches
    # (TritonDeltaMixer.warmup: the four kernels) compiled through ptxas for each target and model shape, and a sweep
    # of batches of every kind through the Triton mixer meets no variant the warm-up did not.
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "triton_aot.py"), "gated-delta"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert len(results) == 2 * len(triton_aot.GATED_DELTA_CONFIGS)
    for result in results:
        where = f"sm_{result['arch']} {result['dtype']} state {result['state_dtype']} {result['shape']}"
        assert len(result["compiled"]) == triton_aot.GATED_DELTA_KERNELS, where
        assert len(result["launches"]) == 2 * len(triton_aot.GATED_DELTA_BATCHES), where
        assert result["serving_keys"] == result["warmup_keys"], where
        assert all(c["arch"] == result["arch"] for c in result["compiled"]), where
        assert all(c["shared_bytes"] <= triton_aot.SHARED_LIMIT[result["arch"]] for c in result["compiled"]), where
