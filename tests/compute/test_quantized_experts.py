"""Quantized MoE experts (worker/layers/expert_weights.py): each rank's expert weight equals its shard of the format's
own dequantized weight (GPTQ, AWQ, FP8 blocks, compressed-tensors INT4; column and row parallel); in the worker,
each format's checkpoint equals the same weights dequantized into a plain one, for one batch mixing the base model,
an attention-only adapter and an adapter on every expert (fp32 logits, greedy tokens), holding fewer bytes than
plain experts; --load-format dummy draws quantized experts; a TP cut inside a group, a stacked quantized tensor and
partly quantized experts are refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from loraplex.worker.layers.moe import ExpertsLinear
from loraplex.worker.parallel import tensor_parallel
from loraplex.worker.quant import QuantFormatError, quantized_linears
from loraplex.worker.quant.formats import build_format, random_tensors

from tests.compute.test_quantized_coverage import set_ignore
from tests.lora_helpers import LORA_CONFIG, batch_logits, greedy_decode, load_all
from tests.quantized_moe import EXPERT_FORMATS, build_quantized_moe
from tests.worker_helpers import make_runner, prefill_logits, random_prompts

FP32_TOL = 1e-4
NAMES = [None, "a4", "a8", "a8", None]
LENGTHS = [6, 9, 4, 11, 5]
# the most each format's experts may hold, as a share of the same experts in fp32 (values, scales and zero points)
MAX_SHARE = {"fp8-block": 0.3, "awq-4bit": 0.25, "ct-w4a16": 0.25}


@pytest.fixture(scope="module")
def quantized_moe(tmp_path_factory: pytest.TempPathFactory):
    return build_quantized_moe(tmp_path_factory.mktemp("quantized-moe"))


def experts_of(runner) -> list[ExpertsLinear]:
    return [m for m in runner.model.modules() if isinstance(m, ExpertsLinear)]


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_quantized_experts_equal_their_dequantized_model(fmt: str, quantized_moe) -> None:
    checkpoints, adapters = quantized_moe
    runners = [make_runner(path, **LORA_CONFIG) for path in checkpoints[fmt]]
    quantized, plain = (experts_of(runner) for runner in runners)
    assert all(m.is_quantized for m in quantized) and not any(m.is_quantized for m in plain)
    held = sum(m.resident_bytes for m in quantized)
    assert held <= MAX_SHARE[fmt] * sum(m.resident_bytes for m in plain), (fmt, held)
    prompts = random_prompts(LENGTHS, runners[0].vocab_size, seed=4)
    results = []
    for runner in runners:
        load_all(runner, adapters)
        results.append((batch_logits(runner, prompts, NAMES), greedy_decode(runner, prompts, NAMES, steps=4)))
    (ours, our_tokens), (ref, ref_tokens) = results
    for name, a, b in zip(NAMES, ours, ref, strict=True):
        assert (a - b).abs().max() <= FP32_TOL, (fmt, name)
    assert our_tokens == ref_tokens


def test_dummy_weights_draw_quantized_experts(quantized_moe, tmp_path: Path) -> None:
    checkpoints, _ = quantized_moe
    config_only = tmp_path / "fp8-dummy"
    config_only.mkdir()
    shutil.copy(checkpoints["fp8-block"][0] / "config.json", config_only / "config.json")
    runners = [make_runner(config_only, load_format="dummy") for _ in range(2)]
    experts = experts_of(runners[0])
    assert all(m.is_quantized and m.storage.stacked.q.dtype == torch.float8_e4m3fn for m in experts)
    weight = experts[0].expert_weight(1)
    assert 0.01 < weight.float().std() < 0.05  # ~ N(0, initializer_range 0.02)
    prompt = random_prompts([7], runners[0].vocab_size, seed=2)[0]
    assert torch.equal(*(prefill_logits(runner, prompt) for runner in runners))  # seeded: the same draw each time


def _int4_pieces(fmt, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
    weight = fmt.random_weight(out_features, in_features, 0.02, torch.Generator().manual_seed(0))
    return fmt.encode(weight)


CONFIGS = {  # quantization_config -> each checkpoint format the experts read
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 16, "version": "gemm"},
    "fp8": {"quant_method": "fp8", "weight_block_size": [16, 16]},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                       "strategy": "group", "group_size": 16}}}},
}  # fmt: skip


@pytest.mark.parametrize("method", sorted(CONFIGS))
@pytest.mark.parametrize("tp_mode", ["column", "row"])
def test_each_rank_s_expert_weight_is_its_shard_of_the_format_s_dequantized_weight(method: str, tp_mode: str) -> None:
    fmt = build_format(method, CONFIGS[method])
    out_sizes, in_size = ([32, 32], 64) if tp_mode == "column" else ([48], 64)
    generator = torch.Generator().manual_seed(1)
    pieces = {(e, s): random_tensors(fmt, size, in_size, 0.02, generator)
              for e in range(3) for s, size in enumerate(out_sizes)}  # fmt: skip
    full = [torch.cat([fmt.decode(pieces[e, s], size, in_size).dequantize(slice(None), torch.float32)
                       for s, size in enumerate(out_sizes)]) for e in range(3)]  # fmt: skip
    for rank in (0, 1):
        with tensor_parallel(rank, 2), quantized_linears(fmt):
            linear = ExpertsLinear(3, in_size, out_sizes, tp_mode)
        for (e, s), tensors in pieces.items():
            for name, tensor in tensors.items():
                getattr(linear, name).weight_loader(getattr(linear, name), tensor, (e, s))
        assert linear.is_quantized and not hasattr(linear, fmt.tensor_names[0])  # staged tensors dropped
        for e in range(3):
            if tp_mode == "column":  # this rank's rows of each slice
                expected = torch.cat([part.chunk(2)[rank] for part in full[e].split(out_sizes)])
            else:
                expected = full[e].chunk(2, dim=1)[rank]
            assert torch.equal(linear.expert_weight(e).float(), expected), (method, tp_mode, rank, e)
        assert linear.resident_bytes < linear.num_weights * 4 // 3


def test_a_tp_cut_inside_a_group_and_a_stacked_tensor_are_refused() -> None:
    fmt = build_format("awq", {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"})
    with tensor_parallel(0, 2), quantized_linears(fmt):
        down = ExpertsLinear(2, 96, [64], "row")  # 48 inputs per rank: the second group of 32 is cut
    pieces = _int4_pieces(fmt, 64, 96)
    with pytest.raises(ValueError, match="splits a quantization group of 32"):
        for name, tensor in pieces.items():
            getattr(down, name).weight_loader(getattr(down, name), tensor, (0, 0))
    with tensor_parallel(0, 1), quantized_linears(fmt):
        down = ExpertsLinear(2, 96, [64], "row")
    with pytest.raises(ValueError, match="read per expert"):
        down.qweight.weight_loader(down.qweight, pieces["qweight"][None].expand(2, -1, -1), None)


def test_experts_partly_left_plain_are_refused(quantized_moe, tmp_path: Path) -> None:
    checkpoints, _ = quantized_moe
    ct_dir = checkpoints["ct-w4a16"][0]
    partly = tmp_path / "partly"
    shutil.copytree(ct_dir, partly)
    set_ignore(partly, ["lm_head", "re:.*experts.0.up_proj$"])
    with pytest.raises(QuantFormatError, match="leaves some of model.layers.0.mlp.experts.gate_up_proj's experts"):
        make_runner(partly)
