"""Mixture-of-experts models (Mixtral, OLMoE, Qwen3-MoE) in the worker against HF transformers + peft in fp32: the base
model and two expert adapters (PEFT's per-expert form, and its target_parameters form with a rank/alpha pattern)
mixed in one batch, prefill logits and greedy decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loraplex.protocol.structs import AdapterToLoad
from loraplex.worker.layers.moe import ExpertsLinear
from loraplex.worker.lora.experts import LoRAExpertsLinear
from loraplex.worker.model_runner import ModelRunner

from tests.device_helpers import USES_GPU
from tests.lora_helpers import ADAPTER_IDS, batch_logits, greedy_decode, load_all
from tests.moe_models import ARCHS, build_moe_set
from tests.reference import assert_greedy_matches_peft, assert_logits_match_peft
from tests.worker_helpers import make_runner, random_prompts

LOGITS_TOL = 1e-3  # fp32, logits of magnitude ~10 through three layers of top-2 experts
MIN_ADAPTER_EFFECT = 0.1
DECODE_STEPS = 6
NAMES = [None, "a4", "a4", "a8", None, "a8"]  # base rows between adapters, a segment of two requests
LENGTHS = [5, 9, 3, 12, 7, 4]
MOE_LORA = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"], max_loras_per_batch=3)


@pytest.fixture(scope="module", params=ARCHS)
def moe_set(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, dict[str, Path]]:
    model_dir, adapters = build_moe_set(tmp_path_factory.mktemp("moe"), request.param)
    return request.param, model_dir, adapters


@pytest.fixture(scope="module")
def runner(moe_set) -> ModelRunner:
    _, model_dir, adapters = moe_set
    runner = make_runner(model_dir, **MOE_LORA)
    load_all(runner, adapters)
    return runner


def test_experts_are_wrapped(moe_set, runner: ModelRunner) -> None:
    arch = moe_set[0]
    moe_layers = [layer for layer in runner.model.model.layers if hasattr(layer.mlp, "experts")]
    assert len(moe_layers) == (2 if arch == "qwen3_moe" else 3)  # Qwen3-MoE's layer 1 is dense (mlp_only_layers)
    for layer in moe_layers:
        for linear in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            assert isinstance(linear, LoRAExpertsLinear) and isinstance(linear.base, ExpertsLinear)
    buffers = runner.lora.pool.buffers[(0, "mlp.experts.gate_up_proj")]
    assert tuple(buffers.lora_a.shape) == (3 * 4, 2 * 8, 64) and buffers.num_experts == 4  # (slots * experts, ...)


def test_mixed_batch_logits_match_peft(moe_set, runner: ModelRunner) -> None:
    _, model_dir, adapters = moe_set
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=11)
    ours = batch_logits(runner, prompts, NAMES)
    assert_logits_match_peft(ours, prompts, NAMES, model_dir, adapters, LOGITS_TOL, MIN_ADAPTER_EFFECT)


def test_strength_reaches_the_expert_terms(moe_set, runner: ModelRunner) -> None:
    # lora_scale per row through the experts' regrouped rows: 0 is the base model, 1 the adapter, 2 neither
    if moe_set[0] != "mixtral":
        pytest.skip("one family is enough: the regrouping is the same code for every MoE family")
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=11)
    plain, base = batch_logits(runner, prompts, NAMES), batch_logits(runner, prompts, [None] * len(NAMES))
    scaled = batch_logits(runner, prompts, NAMES, [1.0, 0.0, 1.0, 2.0, 1.0, 0.0])
    for row in (1, 5):
        torch.testing.assert_close(scaled[row], base[row], atol=1e-5, rtol=1e-5)
    for row in (0, 2):
        torch.testing.assert_close(scaled[row], plain[row], atol=1e-5, rtol=1e-5)
    assert (scaled[3] - plain[3]).abs().max() > 1e-2 and (scaled[3] - base[3]).abs().max() > 1e-2


def test_mixed_batch_greedy_matches_peft(moe_set, runner: ModelRunner) -> None:
    _, model_dir, adapters = moe_set
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=12)
    ours = greedy_decode(runner, prompts, NAMES, steps=DECODE_STEPS)
    assert_greedy_matches_peft(ours, prompts, NAMES, model_dir, adapters, DECODE_STEPS)


@pytest.mark.skipif(USES_GPU, reason="checked in the interpreter here; on a GPU the compiled kernels run everywhere")
def test_triton_kernels_serve_the_experts_as_torch_does(moe_set) -> None:
    """The Triton backend (the interpreter without a GPU), warmed up for the experts' segment counts, gives the
    torch backend's logits on the same mixed batch."""
    _, model_dir, adapters = moe_set
    specs = [AdapterToLoad(lora_name=name, lora_path=str(path), lora_id=ADAPTER_IDS[name])
             for name, path in adapters.items()]  # fmt: skip
    prompts = random_prompts([3, 4, 2], 256, seed=13)
    names = [None, "a4", "a8"]
    logits = {}
    for backend in ("torch", "triton"):
        runner = make_runner(model_dir, **MOE_LORA, lora_backend=backend)
        assert all(r.success for r in runner.lora.load(specs))
        logits[backend] = batch_logits(runner, prompts, names)
    for ours, ref in zip(logits["triton"], logits["torch"], strict=True):
        torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-4)
