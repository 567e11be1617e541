"""A mix's weights (frontend/adapters/mix_merge.py) equal PEFT's add_weighted_adapter of the same adapters: `linear`
as PEFT's "cat", `ties` and `dare_linear` with the same density and seed (fp32, offline)."""

from __future__ import annotations

import pytest
import torch
from loraplex.frontend.adapters.files import read_adapter_config
from loraplex.frontend.adapters.mix_merge import MixMergeError, merge
from loraplex.protocol.adapters.lora_targets import ATTN_MODULES, TARGET_MODULES
from safetensors.torch import load_file

from tests.builders import build_lora_adapter
from tests.reference import peft_mix

WEIGHTS = {"m1": 0.7, "m2": -0.3, "m3": 1.2}


@pytest.fixture(scope="module")
def mix_adapters(tmp_path_factory, llama_dir):
    """Three rank-8 adapters on every target with different alphas (PEFT's ties and dare_linear need one rank)."""
    root = tmp_path_factory.mktemp("mix-adapters")
    for seed, (name, alpha) in enumerate({"m1": 16, "m2": 8, "m3": 32}.items(), start=20):
        build_lora_adapter(llama_dir, root / name, r=8, lora_alpha=alpha, target_modules=TARGET_MODULES, seed=seed)
    return {name: root / name for name in WEIGHTS}


def ours(dirs, how, density=0.5, seed=0):
    parts = [(read_adapter_config(name, str(path)), load_file(str(path / "adapter_model.safetensors")))
             for name, path in dirs.items()]  # fmt: skip
    return merge(parts, list(WEIGHTS.values()), how, density, seed)


def peft_tensors(llama_dir, dirs, combination_type, density=None, seed=0):
    from peft import get_peft_model_state_dict

    model = peft_mix(llama_dir, dirs, list(WEIGHTS.values()), combination_type, density, seed)
    return model.peft_config["mix"], get_peft_model_state_dict(model, adapter_name="mix")


@pytest.mark.parametrize("how,peft_name,density", [("linear", "cat", None), ("ties", "ties", 0.5),
                                                    ("dare_linear", "dare_linear", 0.6)])  # fmt: skip
def test_mix_equals_peft(llama_dir, mix_adapters, how, peft_name, density):
    config, tensors = ours(mix_adapters, how, density or 1.0, seed=3)
    peft_config, expected = peft_tensors(llama_dir, mix_adapters, peft_name, density, seed=3)
    assert set(tensors) == set(expected)
    for key, tensor in expected.items():
        torch.testing.assert_close(tensors[key], tensor, atol=1e-6, rtol=1e-5, msg=key)
    assert config["r"] == peft_config.r == config["lora_alpha"] == peft_config.lora_alpha
    assert config["r"] == (24 if how == "linear" else 8) and not config["rank_pattern"]
    if how == "linear":  # exactly the weighted sum of the deltas
        key = "base_model.model.model.layers.1.mlp.down_proj"
        delta = tensors[f"{key}.lora_B.weight"] @ tensors[f"{key}.lora_A.weight"]
        parts = [(read_adapter_config(n, str(p)), load_file(str(p / "adapter_model.safetensors")))
                 for n, p in mix_adapters.items()]  # fmt: skip
        want = sum(w * c.scale * t[f"{key}.lora_B.weight"] @ t[f"{key}.lora_A.weight"]
                   for w, (c, t) in zip(WEIGHTS.values(), parts, strict=True))  # fmt: skip
        torch.testing.assert_close(delta, want, atol=1e-6, rtol=1e-5)


def test_mixes_of_different_targets_or_ranks_are_refused(tmp_path, llama_dir, mix_adapters):
    build_lora_adapter(llama_dir, tmp_path / "attn", r=8, lora_alpha=8, target_modules=ATTN_MODULES, seed=5)
    build_lora_adapter(llama_dir, tmp_path / "r4", r=4, lora_alpha=8, target_modules=TARGET_MODULES, seed=6)
    for other, hows in ((tmp_path / "attn", ("linear",)), (tmp_path / "r4", ("ties", "dare_linear"))):
        dirs = {"m1": mix_adapters["m1"], "m2": mix_adapters["m2"], "x": other}
        for how in hows:
            with pytest.raises(MixMergeError):
                ours(dirs, how)
    config, _ = ours({"m1": mix_adapters["m1"], "m2": mix_adapters["m2"], "x": tmp_path / "r4"}, "linear")
    assert config["r"] == 20  # linear stacks any ranks
