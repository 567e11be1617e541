"""DoRA adapters in the worker against HF transformers + peft, in one batch with a plain adapter and the base model;
a slot that held a DoRA adapter and then a plain one; PEFT's fused modules (Phi-3); a quantized base; the refusals;
the norms read through a layer with a bias."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from loraplex.protocol.adapters.lora_targets import TARGET_MODULES
from loraplex.protocol.structs import AdapterToLoad, SlotLoad
from loraplex.worker.layers.linear import MergedColumnParallelLinear
from loraplex.worker.lora.dora import base_rows_sq, weight_norm_sq
from loraplex.worker.model_runner import ModelRunner

from tests.lora_helpers import (
    DORA_IDS,
    DORA_MIXED,
    DORA_SLOTS,
    build_dora_adapters,
    build_peft_adapter,
    dora_batch_logits,
)
from tests.phi3_helpers import PHI3_TARGETS, build_tiny_phi3
from tests.quantize_checkpoint import write_quantized
from tests.reference import assert_logits_match_peft
from tests.worker_helpers import make_runner, random_prompts

FP32_TOL = 1e-4
MIN_ADAPTER_EFFECT = 0.1
DORA_CONFIG = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"], max_loras_per_batch=3)


@pytest.fixture(scope="module")
def dora_dirs(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> dict[str, Path]:
    return build_dora_adapters(llama_dir, tmp_path_factory.mktemp("dora"))


@pytest.fixture(scope="module")
def runner(llama_dir: Path) -> ModelRunner:
    return make_runner(llama_dir, **DORA_CONFIG)


def test_dora_mixed_batch_matches_peft(runner: ModelRunner, llama_dir: Path, dora_dirs: dict[str, Path]) -> None:
    prompts = random_prompts([5, 9, 3, 7, 6, 8, 4], runner.vocab_size, seed=7)
    ours = dora_batch_logits(runner, dora_dirs, prompts, DORA_MIXED)
    assert runner.lora.pool.dora_slots == {DORA_SLOTS["dora"], DORA_SLOTS["dora_qv"]}
    assert_logits_match_peft(ours, prompts, DORA_MIXED, llama_dir, dora_dirs, FP32_TOL, MIN_ADAPTER_EFFECT)

    # The plain adapter into the DoRA adapter's slot: its rows are no longer rescaled
    slot = DORA_SLOTS["dora"]
    runner.lora.apply_slot_loads([SlotLoad(slot=slot, lora_id=DORA_IDS["plain"])])
    assert slot not in runner.lora.pool.dora_slots
    runner.lora.apply_slot_loads([SlotLoad(slot=slot, lora_id=DORA_IDS["dora"])])  # and back
    again = dora_batch_logits(runner, dora_dirs, prompts[:3], DORA_MIXED[:3])
    assert_logits_match_peft(again, prompts[:3], DORA_MIXED[:3], llama_dir, dora_dirs, FP32_TOL, MIN_ADAPTER_EFFECT)


def _copy_with(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, **config_changes}))
    return dst


@pytest.mark.parametrize(
    ("source", "changes", "message"),
    [
        ("dora", {"use_dora": False}, "is a DoRA magnitude, but use_dora is false"),
        ("plain", {"use_dora": True}, "missing lora_magnitude_vector"),
        ("dora", {"use_dora": "yes"}, "'use_dora' must be true or false"),
    ],
)
def test_dora_refusals(runner: ModelRunner, dora_dirs: dict[str, Path], tmp_path: Path, source: str,
                       changes: dict, message: str) -> None:  # fmt: skip
    path = _copy_with(dora_dirs[source], tmp_path / "edited", **changes)
    [outcome] = runner.lora.load([AdapterToLoad(lora_name="edited", lora_path=str(path), lora_id=99)])
    assert not outcome.success and message in outcome.error_message, outcome.error_message


def test_dora_on_fused_modules_matches_peft(tmp_path: Path) -> None:
    """Phi-3's fused qkv_proj and gate_up_proj: PEFT's one magnitude per fused module, split into its slices."""
    base = tmp_path / "phi3"
    build_tiny_phi3(base)
    dirs = {"dora": tmp_path / "dora"}
    build_peft_adapter(base, dirs["dora"], r=8, lora_alpha=16, target_modules=PHI3_TARGETS, seed=5, use_dora=True)
    runner = make_runner(base, **DORA_CONFIG)
    prompts = random_prompts([6, 9, 5], runner.vocab_size, seed=9)
    names = [None, "dora", "dora"]
    ours = dora_batch_logits(runner, dirs, prompts, names)
    assert_logits_match_peft(ours, prompts, names, base, dirs, FP32_TOL, MIN_ADAPTER_EFFECT)


def test_dora_on_a_quantized_base_matches_peft_on_its_dequantized_weights(llama_dir: Path, tmp_path: Path) -> None:
    """The norms come from the weight the 4-bit layer computes with: PEFT on the dequantized checkpoint is the
    reference."""
    quant_dir, dequant_dir = tmp_path / "gptq", tmp_path / "dequantized"
    write_quantized(llama_dir, "gptq-4bit", quant_dir, dequant_dir)
    dirs = {"dora": tmp_path / "dora"}
    build_peft_adapter(dequant_dir, dirs["dora"], r=8, lora_alpha=16, target_modules=TARGET_MODULES, seed=6,
                       use_dora=True)  # fmt: skip
    runner = make_runner(quant_dir, **DORA_CONFIG)
    prompts = random_prompts([7, 5, 8], runner.vocab_size, seed=4)
    names = ["dora", None, "dora"]
    ours = dora_batch_logits(runner, dirs, prompts, names)
    assert_logits_match_peft(ours, prompts, names, dequant_dir, dirs, FP32_TOL, MIN_ADAPTER_EFFECT)


class _ThroughTheLayer:
    """Stands in for a weight that the layer holds only in a form it multiplies by (quantized or packed): x·Wᵀ."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.device, self.dtype = weight, weight.device, weight.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


def test_dora_norms_through_the_layer_leave_out_its_bias() -> None:
    """‖W + scale·B·A‖² per row of each slice of a fused layer with a bias (Qwen2's qkv), read from its plain weight
    and through the layer (as a quantized or packed weight is read), against the rows computed whole in float64."""
    generator = torch.Generator().manual_seed(3)
    linear = MergedColumnParallelLinear(48, [32, 16, 16], bias=True)
    weight = torch.randn(64, 48, generator=generator)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(torch.randn(64, generator=generator) * 3)
    through = MergedColumnParallelLinear(48, [32, 16, 16], bias=True)
    with torch.no_grad():
        through.bias.copy_(linear.bias)
    del through.weight
    through.quant = _ThroughTheLayer(weight)
    scale = 2.0
    for rows in (slice(0, 32), slice(32, 48), slice(48, 64)):
        lora_a = torch.randn(4, 48, generator=generator)
        lora_b = torch.randn(rows.stop - rows.start, 4, generator=generator)
        expected = (weight[rows].double() + scale * lora_b.double() @ lora_a.double()).square().sum(dim=1)
        for layer in (linear, through):
            base_sq = base_rows_sq(layer)[rows]
            ours = weight_norm_sq(layer, rows, lora_a, lora_b, scale, base_sq)
            assert torch.allclose(ours.double(), expected, rtol=1e-5), (rows, layer is through)
