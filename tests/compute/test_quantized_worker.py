"""Quantized bases under LoRA in the worker, each format against HF transformers + peft running the same weights
dequantized into a plain checkpoint: one batch mixing the base model and two adapters, logits and greedy tokens in
fp32 activations; the CPU kernels each format is meant to take; a QLoRA adapter trained by peft on the 4-bit base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loraplex.kernels import cpu_gemv
from loraplex.worker.model_runner import ModelRunner
from loraplex.worker.quant.avx2 import Avx2IntMatmul

from tests.lora_helpers import LORA_CONFIG, batch_logits, greedy_decode, specs
from tests.quantize_checkpoint import FORMATS, write_quantized
from tests.reference import assert_greedy_matches_peft, hf_logits
from tests.worker_helpers import make_runner, random_prompts

FP32_TOL = 1e-4
DECODE_STEPS = 6
NAMES = [None, "a4", "a16", None, "a4", "a16"]  # the base and two adapters, mixed
USED_IDS = {"a4": 1, "a16": 3}  # ids and slots as tests/lora_helpers.py gives them
LENGTHS = [5, 9, 3, 12, 7, 4]
EXPECTED_KERNEL = {  # the CPU kernel each format's linears take (matmul.py)
    "gptq-4bit": "int4 weight-only (torch CPU)",
    "gptq-4bit-act-order": "int4 weight-only (torch CPU)",
    "awq-4bit": "int4 weight-only (torch CPU)",
    "ct-w4a16": "int4 weight-only (torch CPU)",
    "ct-w4a16-asym": "int4 weight-only (torch CPU)",
    "ct-w4a16-actorder-weight": "int4 weight-only (torch CPU)",
    "ct-w4a16-actorder-static": "int4 weight-only (torch CPU)",
    "ct-w4a16-actorder-group": "int4 weight-only (torch CPU)",  # act order permuted into whole groups at load
    "ct-w8a16": "int8 weight-only (torch CPU)",
}
TILES = "dequantize per tile"


@pytest.fixture(scope="module")
def checkpoints(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """format -> (quantized dir, dequantized plain dir), written on first use."""
    root = tmp_path_factory.mktemp("quantized")
    made: dict[str, tuple[Path, Path]] = {}

    def get(fmt: str) -> tuple[Path, Path]:
        if fmt not in made:
            made[fmt] = (root / fmt, root / f"{fmt}-dequantized")
            write_quantized(llama_dir, fmt, *made[fmt])
        return made[fmt]

    return get


def load_two(runner: ModelRunner, adapter_dirs: dict[str, Path]) -> None:
    results = runner.lora.load(specs(adapter_dirs, USED_IDS))
    assert all(r.success for r in results), [r.error_message for r in results if not r.success]


def kernels(runner: ModelRunner) -> set[str]:
    return {m.quant.matmul.name for m in runner.model.modules() if getattr(m, "quant", None) is not None}


def assert_matches_reference(runner: ModelRunner, dequant_dir: Path, adapters: dict[str, Path],
                             names: list[str | None]) -> None:
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=5)
    for prompt, name, logits in zip(prompts, names, batch_logits(runner, prompts, names), strict=True):
        ref = hf_logits(dequant_dir, prompt, None if name is None else adapters[name])
        diff = (logits - ref).abs().max().item()
        assert diff <= FP32_TOL, f"{name or 'base'}: max abs logit diff {diff:.2e}"
    outputs = greedy_decode(runner, prompts, names, steps=DECODE_STEPS)
    assert_greedy_matches_peft(outputs, prompts, names, dequant_dir, adapters, DECODE_STEPS)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_base_and_adapters_match_hf_on_dequantized_weights(
    fmt: str, checkpoints, adapter_dirs: dict[str, Path]
) -> None:
    quant_dir, dequant_dir = checkpoints(fmt)
    runner = make_runner(quant_dir, **LORA_CONFIG)
    assert runner.quant_format.method == fmt.split("-")[0].replace("ct", "compressed-tensors")
    avx2 = cpu_gemv.chosen_for_int() and "fp8" not in fmt  # a CPU with AVX2 or AVX-512 BF16: every INT format
    assert kernels(runner) == {Avx2IntMatmul.name if avx2 else EXPECTED_KERNEL.get(fmt, TILES)}
    assert not any(name.endswith((".weight", ".qweight")) and "proj" in name
                   for name, _ in runner.model.named_parameters())  # no plain copy and no staged tensor is kept
    load_two(runner, adapter_dirs)
    assert_matches_reference(runner, dequant_dir, adapter_dirs, NAMES)


def test_bfloat16_kernels_err_no_more_than_plain_bfloat16(checkpoints) -> None:
    # In bf16 activations the int4/int8 kernels round differently from a bf16 matmul on the dequantized weights:
    # against the fp32 oracle (our fp32 run of the dequantized checkpoint) their error stays that of plain bf16.
    for fmt in ("gptq-4bit-act-order", "ct-w8a16"):
        quant_dir, dequant_dir = checkpoints(fmt)
        prompts = random_prompts(LENGTHS[:3], 1000, seed=6)
        ours, plain, oracle = (batch_logits(make_runner(path, dtype=dtype), prompts, [None] * 3)
                               for path, dtype in ((quant_dir, "bfloat16"), (dequant_dir, "bfloat16"),
                                                   (dequant_dir, "float32")))
        ours_err = max((a.float() - c).abs().max().item() for a, c in zip(ours, oracle, strict=True))
        plain_err = max((b.float() - c).abs().max().item() for b, c in zip(plain, oracle, strict=True))
        assert ours_err <= 1.5 * plain_err, (fmt, ours_err, plain_err)
        # top-1 as the oracle's as often as plain bf16's (the tiny model's logits are near-flat: bf16 noise flips some)
        ours_agree, plain_agree = (sum((a.argmax(-1) == c.argmax(-1)).sum().item()
                                       for a, c in zip(x, oracle, strict=True)) for x in (ours, plain))
        assert ours_agree >= plain_agree - 1 >= 0.8 * sum(LENGTHS[:3]) - 1, (fmt, ours_agree, plain_agree)


def train_qlora_adapter(dequant_dir: Path, out_dir: Path) -> None:
    """A few steps of peft LoRA training on the 4-bit base (its dequantized weights, frozen), as QLoRA trains."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(dequant_dir), dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    model = get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    tokens = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(8):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(str(out_dir))


def test_qlora_adapter_on_the_int4_base_matches_peft(checkpoints, adapter_dirs, tmp_path: Path) -> None:
    quant_dir, dequant_dir = checkpoints("gptq-4bit-act-order")
    train_qlora_adapter(dequant_dir, tmp_path / "qlora")
    adapters = {**adapter_dirs, "a16": tmp_path / "qlora"}  # in a16's slot, beside a4 built on the plain base
    runner = make_runner(quant_dir, **LORA_CONFIG)
    load_two(runner, adapters)
    prompt = random_prompts([8], runner.vocab_size, seed=7)[0]
    trained = hf_logits(dequant_dir, prompt, tmp_path / "qlora")
    assert (trained - hf_logits(dequant_dir, prompt, None)).abs().max().item() > 0.1  # training moved it
    assert_matches_reference(runner, dequant_dir, adapters, NAMES)
