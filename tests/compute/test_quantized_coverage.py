"""Which modules a quantized checkpoint quantizes, against how the worker reads them, decided before any weight is
read: FP8 MoE experts load quantized (worker/layers/expert_weights.py), with real weights and with --load-format
dummy; a compressed-tensors `ignore` naming modules the server does not build (a vision tower, an MoE router, the LM
head) starts, one naming a decoder linear is refused; experts the checkpoint leaves plain are read plain."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from loraplex.worker.loader import checkpoint_module_names
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.registry import build_model
from loraplex.worker.parallel import tensor_parallel
from loraplex.worker.quant import QuantFormatError, check_coverage, quantized_linears
from loraplex.worker.quant.formats import build_format

from tests.moe_models import build_moe_model, hf_config
from tests.quantize_checkpoint import write_quantized
from tests.worker_helpers import make_runner, prefill_logits, random_prompts

FP8_FORMATS = {"fp8-block": "fp8 in 128x128 blocks", "ct-fp8-channel": "compressed-tensors float-quantized float8 "
               "per channel"}  # fmt: skip
# what llm-compressor writes for an MoE model: the router and the LM head stay in full precision
MOE_IGNORE = ["lm_head", "re:.*mlp.gate$"]


def set_ignore(model_dir: Path, ignore: list[str]) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"]["ignore"] = ignore
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("arch", ["olmoe", "qwen3_moe"])
@pytest.mark.parametrize("fmt", sorted(FP8_FORMATS))
def test_fp8_moe_experts_load_quantized(arch: str, fmt: str, tmp_path: Path) -> None:
    build_moe_model(tmp_path / "plain", arch)
    quant_dir = tmp_path / fmt
    write_quantized(tmp_path / "plain", fmt, quant_dir, None)  # attention and every expert in FP8
    if fmt.startswith("ct-"):
        set_ignore(quant_dir, MOE_IGNORE)
    config_only = tmp_path / "dummy"
    config_only.mkdir()
    shutil.copy(quant_dir / "config.json", config_only / "config.json")
    for model_dir, load_format in ((quant_dir, "auto"), (config_only, "dummy")):
        runner = make_runner(model_dir, load_format=load_format)
        experts = [m for m in runner.model.modules() if hasattr(m, "checkpoint_shards")]
        assert experts and all(m.storage.stacked.q.dtype == torch.float8_e4m3fn for m in experts), FP8_FORMATS[fmt]


def test_an_ignore_list_naming_modules_not_built_starts(llama_dir: Path, tmp_path: Path) -> None:
    write_quantized(llama_dir, "ct-w4a16", tmp_path / "plain-ignore", None)
    shutil.copytree(tmp_path / "plain-ignore", tmp_path / "wide-ignore")
    set_ignore(tmp_path / "wide-ignore", ["lm_head", "re:visual.*", "re:.*mlp.gate$", "model.vision_tower"])
    runners = [make_runner(tmp_path / name) for name in ("plain-ignore", "wide-ignore")]
    assert all(len([m for m in r.model.modules() if getattr(m, "quant", None) is not None]) == 8 for r in runners)
    prompt = random_prompts([7], runners[0].vocab_size, seed=2)[0]
    assert torch.equal(*(prefill_logits(runner, prompt) for runner in runners))


@pytest.mark.parametrize("ignored", ["re:.*down_proj", "model.layers.1.self_attn.k_proj"])
def test_an_ignore_list_naming_a_decoder_linear_is_refused(ignored: str, llama_dir: Path, tmp_path: Path) -> None:
    write_quantized(llama_dir, "ct-w4a16", tmp_path, None)
    set_ignore(tmp_path, ["lm_head", ignored])
    with pytest.raises(QuantFormatError, match="leaves model.layers.[01].(mlp.down|self_attn.k)_proj in full"):
        make_runner(tmp_path)


def test_mixtral_experts_are_found_under_its_names_and_may_be_ignored() -> None:
    # Mixtral's checkpoints name the block block_sparse_moe and the experts' linears w1/w3/w2
    config = ModelConfig.from_dict(hf_config("mixtral").to_dict())
    fp8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}
    for ignore, quantized in ((MOE_IGNORE, True), ([*MOE_IGNORE, "re:.*block_sparse_moe.experts.*"], False)):
        fmt = build_format("compressed-tensors", {**fp8, "ignore": ignore})
        with tensor_parallel(0, 1), quantized_linears(fmt):
            model = build_model(config, max_positions=64)
        pieces = checkpoint_module_names(model, "model.layers.2.mlp.experts.gate_up_proj")
        assert "model.layers.2.block_sparse_moe.experts.3.w3" in pieces[3 * 2 + 1]  # (expert 3, up)
        check_coverage(fmt, model)
        experts = model.get_submodule("model.layers.2.mlp.experts.gate_up_proj")
        # read in FP8, or plain where the checkpoint stores them plain
        assert experts.is_quantized == quantized and hasattr(experts, "weight_scale") == quantized


def test_an_fp8_kv_cache_s_static_scales_load_and_change_nothing(llama_dir: Path, tmp_path: Path) -> None:
    # llm-compressor's kv_cache_scheme stores k_scale/v_scale per attention layer; the cache here keeps the model
    # dtype, so the checkpoint serves exactly as without them
    from safetensors.torch import load_file, save_file

    write_quantized(llama_dir, "ct-fp8-channel", tmp_path / "plain-kv", None)
    shutil.copytree(tmp_path / "plain-kv", tmp_path / "fp8-kv")
    path = tmp_path / "fp8-kv" / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                        "dynamic": False, "symmetric": True}
    path.write_text(json.dumps(config))
    (shard,) = (tmp_path / "fp8-kv").glob("*.safetensors")
    tensors = load_file(shard)
    for layer in range(config["num_hidden_layers"]):
        for name in ("k_scale", "v_scale"):
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(0.05)
    save_file(tensors, shard)
    runners = [make_runner(tmp_path / name) for name in ("plain-kv", "fp8-kv")]
    prompt = random_prompts([7], runners[0].vocab_size, seed=3)[0]
    assert torch.equal(*(prefill_logits(runner, prompt) for runner in runners))
