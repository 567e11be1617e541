"""--load-format dummy on a quantized config: each format's tensors are drawn in its own checkpoint layout (the
names, shapes and stored dtypes tests/quantize_checkpoint.py writes for a real checkpoint), decode to weights of
the plain dummy draws' scale, go through the checkpoint's weight loaders, and give the same model at every TP
degree; the shipped real quantized configs draw sane weights at their real widths."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from loraplex.worker.dummy_weights import init_dummy_weights
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.registry import build_model
from loraplex.worker.parallel import tensor_parallel
from loraplex.worker.quant import QuantFormat, quantized_linears
from loraplex.worker.quant.formats import build_format, random_tensors
from safetensors import safe_open

from tests.quant_weights import random_int_weight
from tests.quantize_checkpoint import FORMATS, write_quantized
from tests.worker_helpers import make_runner, prefill_logits, random_prompts

STD = 0.02
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "data" / "model_configs"
SHIPPED = sorted(path.parent.name for path in CONFIGS_DIR.glob("*/config.json")
                 if "quantization_config" in json.loads(path.read_text()))


@pytest.fixture(scope="module")
def quantized_dirs(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per format: the tiny Llama written as a real checkpoint by the reference writer."""
    root = tmp_path_factory.mktemp("quantized")
    for fmt in FORMATS:
        write_quantized(llama_dir, fmt, root / fmt, None)
    return {fmt: root / fmt for fmt in FORMATS}


def checkpoint_format(model_dir: Path) -> QuantFormat:
    config = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    return build_format(config["quant_method"], config)


def linear_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Each decoder linear's (out, in)."""
    config = ModelConfig.from_dir(str(model_dir))
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
            "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
            "mlp.down_proj": (hidden, inter)}


def dequantized(fmt: QuantFormat, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    return fmt.decode(tensors, *shape).dequantize(slice(None), torch.float32)


@pytest.mark.parametrize("name", FORMATS)
def test_dummy_tensors_take_the_checkpoints_layout_and_scale(name: str, quantized_dirs: dict[str, Path]) -> None:
    fmt = checkpoint_format(quantized_dirs[name])
    generator = torch.Generator().manual_seed(0)
    with safe_open(str(quantized_dirs[name] / "model.safetensors"), framework="pt") as checkpoint:
        for linear, shape in linear_shapes(quantized_dirs[name]).items():
            prefix = f"model.layers.0.{linear}."
            real = {key.removeprefix(prefix): checkpoint.get_tensor(key) for key in checkpoint.keys()
                    if key.startswith(prefix)}
            drawn = random_tensors(fmt, *shape, STD, generator)
            assert sorted(drawn) == sorted(fmt.tensor_names)
            assert {k: tuple(t.shape) for k, t in drawn.items()} == {k: tuple(t.shape) for k, t in real.items()}
            # the stored values' dtypes (packed int32, FP8, int32 g_idx); scales may be stored in any float dtype
            assert {k: t.dtype for k, t in drawn.items() if "scale" not in k} == {
                k: t.dtype for k, t in real.items() if "scale" not in k}, (name, linear)
            weight = dequantized(fmt, drawn, shape)
            assert abs(weight.std().item() - STD) < 0.1 * STD and abs(weight.mean().item()) < 0.1 * STD, linear
            # encode is decode's inverse: the drawn form comes back exactly
            form = fmt.random_weight(*shape, STD, torch.Generator().manual_seed(1))
            assert torch.equal(dequantized(fmt, fmt.encode(form), shape), form.dequantize(slice(None), torch.float32))


def _ct(weights: dict, fmt: str, inputs: dict | None = None) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}}


# Configs the reference writer does not produce: every tensor a format reads is drawn, and decodes back exactly.
OTHER_CONFIGS = {
    "fp8-tensor-static": {"quant_method": "fp8", "activation_scheme": "static"},
    "gptq-8bit-v2-no-groups": {"quant_method": "gptq", "bits": 8, "group_size": -1, "checkpoint_format": "gptq_v2"},
    "ct-int8-w8a8": _ct({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}, "int-quantized",
                        {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
    "ct-w4a16-act-order": _ct({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                               "group_size": 64, "actorder": "weight"}, "pack-quantized"),
    "ct-w8a16-asym-channel": _ct({"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"},
                                 "pack-quantized"),
    "ct-w4a16-asym-group-order": _ct({"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                                      "group_size": 64, "actorder": "group"}, "pack-quantized"),
}


@pytest.mark.parametrize("name", sorted(OTHER_CONFIGS))
def test_every_format_draws_every_tensor_it_reads(name: str) -> None:
    fmt = build_format(OTHER_CONFIGS[name]["quant_method"], OTHER_CONFIGS[name])
    shape = (96, 256)
    drawn = random_tensors(fmt, *shape, STD, torch.Generator().manual_seed(0))
    assert sorted(drawn) == sorted(fmt.tensor_names)  # a linear builds once it holds all of them
    weight = dequantized(fmt, drawn, shape)
    assert abs(weight.std().item() - STD) < 0.1 * STD and abs(weight.mean().item()) < 0.1 * STD
    form = fmt.random_weight(*shape, STD, torch.Generator().manual_seed(1))
    assert torch.equal(dequantized(fmt, fmt.encode(form), shape), form.dequantize(slice(None), torch.float32))


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_group_order_encodes_scattered_groups(symmetric: bool) -> None:
    # actorder "group": each column's group is its weight_g_idx entry, not its position
    fmt = build_format("compressed-tensors", _ct({"num_bits": 4, "type": "int", "symmetric": symmetric,
                                                  "strategy": "group", "group_size": 32, "actorder": "group"},
                                                 "pack-quantized"))
    weight = random_int_weight(bits=4, group_size=32, signed=True, zeros=not symmetric, act_order=True)
    weight = replace(weight, scales=weight.scales.bfloat16().float())  # as stored
    tensors = fmt.encode(weight)
    assert sorted(tensors) == sorted(fmt.tensor_names) and "weight_g_idx" in tensors
    decoded = fmt.decode(tensors, *weight.shape)
    assert decoded.g_idx is not None and torch.equal(decoded.g_idx, weight.g_idx)
    assert torch.equal(decoded.dequantize(slice(None), torch.float32), weight.dequantize(slice(None), torch.float32))


def dummy_model(model_dir: Path, rank: int, world_size: int) -> torch.nn.Module:
    with tensor_parallel(rank, world_size), quantized_linears(checkpoint_format(model_dir)):
        model = build_model(ModelConfig.from_dir(str(model_dir)), max_positions=64)
    init_dummy_weights(model, STD, seed=0)
    return model


def shard_weight(layer: torch.nn.Module) -> torch.Tensor:
    """(out per rank, in per rank) of a quantized linear, read through its kernel: x = I gives Wᵀ."""
    return layer.quant(torch.eye(layer.input_size_per_rank)).t()


@pytest.mark.parametrize("name", FORMATS)
def test_dummy_quantized_model_is_the_same_at_every_tp_degree(name: str, quantized_dirs: dict[str, Path],
                                                             tmp_path: Path) -> None:
    config_only = tmp_path / name  # no weight files: config.json alone
    config_only.mkdir()
    shutil.copy(quantized_dirs[name] / "config.json", config_only / "config.json")
    full = dummy_model(config_only, 0, 1)
    layers = {name: m for name, m in full.named_modules() if getattr(m, "quant", None) is not None}
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down of each layer: every linear quantized
    for rank in (0, 1):
        shard = dict(dummy_model(config_only, rank, 2).named_modules())
        for layer_name, layer in layers.items():
            weight = shard_weight(layer)
            if layer.tp_mode == "column":  # this rank's rows of each slice
                slices = weight.split(layer.output_sizes, dim=0)
                expected = torch.cat([s.chunk(2, dim=0)[rank] for s in slices])
            else:  # this rank's input columns
                expected = weight.chunk(2, dim=1)[rank]
            assert torch.allclose(shard_weight(shard[layer_name]), expected, rtol=1e-5, atol=1e-7), layer_name
        assert torch.equal(shard["model.embed_tokens"].weight, full.model.embed_tokens.weight)
    qkv = shard_weight(full.model.layers[0].self_attn.qkv_proj)
    assert abs(qkv.std().item() - STD) < 0.1 * STD  # the scale of the plain draws


@pytest.mark.parametrize("name", ["gptq-4bit", "ct-w4a16-asym", "ct-fp8-channel", "fp8-block"])
def test_a_dummy_quantized_runner_needs_only_config_json(name: str, quantized_dirs: dict[str, Path],
                                                         tmp_path: Path) -> None:
    shutil.copy(quantized_dirs[name] / "config.json", tmp_path / "config.json")
    prompt = random_prompts([9], 256, seed=3)[0]
    runners = [make_runner(tmp_path, load_format="dummy", seed=seed) for seed in (0, 0, 1)]
    assert runners[0].quant_format.method == checkpoint_format(tmp_path).method
    logits = [prefill_logits(runner, prompt) for runner in runners]
    assert torch.isfinite(logits[0]).all()
    assert torch.equal(logits[0], logits[1]) and not torch.equal(logits[0], logits[2])


@pytest.mark.parametrize("model", SHIPPED)
def test_shipped_quantized_configs_draw_weights_of_the_plain_scale(model: str) -> None:
    # At the real widths and group sizes (k_proj: kv heads x head_dim by hidden), as the server draws them.
    config = json.loads((CONFIGS_DIR / model / "config.json").read_text())
    fmt = build_format(config["quantization_config"]["quant_method"], config["quantization_config"])
    shape = linear_shapes(CONFIGS_DIR / model)["self_attn.k_proj"]
    weight = dequantized(fmt, random_tensors(fmt, *shape, STD, torch.Generator().manual_seed(0)), shape)
    assert abs(weight.std().item() - STD) < 0.05 * STD and abs(weight.mean().item()) < 0.05 * STD


def test_the_quantized_configs_are_shipped() -> None:
    assert {"Qwen3-8B-FP8", "Meta-Llama-3.1-8B-Instruct-AWQ-INT4", "Qwen2.5-7B-Instruct-GPTQ-Int4",
            "Meta-Llama-3.1-8B-Instruct-quantized.w4a16", "Meta-Llama-3.1-8B-Instruct-FP8-dynamic"} <= set(SHIPPED)
