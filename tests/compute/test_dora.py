"""DoRA adapters in the worker against HF transformers + peft, in one batch with a plain adapter and the base model;
a slot that held a DoRA adapter and then a plain one; PEFT's fused modules (Phi-3); a quantized base; the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from loraplex.protocol.adapters.lora_targets import TARGET_MODULES
from loraplex.protocol.structs import AdapterToLoad, SlotLoad
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
