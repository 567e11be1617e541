"""protocol/adapters/adapter_config.py and adapter_files.py: the one parse of adapter_config.json and the one
confined reader of an adapter directory, as node 0's frontend uses them (the workers' use: test_lora_path_root.py,
test_lora_adapters.py). A file is judged where the open file lies, never by a name checked before the open."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
from loraplex.frontend.adapters.files import read_adapter_config, read_adapter_dir
from loraplex.protocol.adapters.adapter_config import CONFIG_FILE, WEIGHT_FILES, AdapterLoadError, parse_adapter_config
from loraplex.protocol.adapters.adapter_files import AdapterFiles
from loraplex.protocol.adapters.lora_targets import TARGET_MODULES

SAFETENSORS = WEIGHT_FILES[0]
BASE = {"r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj", "q_proj"], "peft_type": "LORA"}


def test_a_config_is_parsed_to_our_module_order():
    config = parse_adapter_config({**BASE, "base_model_name_or_path": "m", "layers_to_transform": [1, 0, 1]})
    assert config.target_modules == ("q_proj", "v_proj")  # once each, in TARGET_MODULES order
    assert (config.r, config.scale, config.layers, config.base_model_name_or_path) == (8, 2.0, (0, 1), "m")
    assert parse_adapter_config({**BASE, "use_rslora": True}).scale == 16 / math.sqrt(8)
    assert parse_adapter_config({**BASE, "target_modules": list(TARGET_MODULES)}).layers is None


def test_moe_forms_and_per_module_patterns_are_read_as_peft_reads_them():
    # Mixtral's expert names are its experts' gate/up/down; target_parameters name the stacked experts' tensors
    mixtral = parse_adapter_config({**BASE, "target_modules": ["q_proj", "w1", "w3", "w2"]})
    assert mixtral.target_modules == ("q_proj", "gate_proj", "up_proj", "down_proj")
    fused = parse_adapter_config(
        {**BASE, "target_modules": None, "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    )
    assert fused.target_modules == ("gate_proj", "up_proj", "down_proj")
    # PEFT itself saves target_modules [] for an adapter on the stacked experts alone
    experts_only = parse_adapter_config(
        {**BASE, "target_modules": [], "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    )
    assert experts_only.target_modules == fused.target_modules
    # the first pattern matching the module's full name (as a suffix after a dot) sets its rank and alpha
    patterns = parse_adapter_config(
        {**BASE, "rank_pattern": {r".*\.gate_up_proj": 16, "q_proj": 4}, "alpha_pattern": {r".*\.gate_up_proj": 32}}
    )
    assert patterns.max_rank == 16
    assert patterns.module_rank_alpha("model.layers.0.mlp.experts.gate_up_proj") == (16, 32)
    assert patterns.module_rank_alpha("model.layers.3.self_attn.q_proj") == (4, 16)
    assert patterns.module_rank_alpha("model.layers.3.self_attn.k_proj") == (8, 16)
    assert patterns.module_rank_alpha("model.layers.3.self_attn.xq_proj") == (8, 16)  # not a whole-name suffix
    # full copies and trainable tokens: PEFT's list form and its dict form of the same
    copies = parse_adapter_config({**BASE, "modules_to_save": ["lm_head", "embed_tokens"],
                                   "trainable_token_indices": {"embed_tokens": [7, 3]}})  # fmt: skip
    assert copies.modules_to_save == ("embed_tokens", "lm_head") and copies.trainable_tokens == (7, 3)
    # PEFT's SEQ_CLS lists both head names; BERT's pooler is its one linear
    heads = parse_adapter_config({**BASE, "modules_to_save": ["pooler", "classifier", "score"]})
    assert heads.modules_to_save == ("score", "classifier", "pooler.dense")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_dora": "yes"}, "'use_dora' must be true or false"),
        ({"use_dora": True, "target_parameters": ["experts.down_proj"]}, r"DoRA \(use_dora: true\) on target_param"),
        ({"modules_to_save": ["lm_head", "norm"]}, r"modules_to_save \['norm'\] is not supported"),
        ({"trainable_token_indices": {"lm_head": [1]}}, "trainable_token_indices on \\['lm_head'\\]"),
        ({"trainable_token_indices": [3, 3]}, "lists a token twice"),
        ({"rank_pattern": {"q_proj": 0}}, "rank_pattern 'q_proj': the value must be a positive integer"),
        ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern 'q_proj': the value must be a number"),
        (
            {"target_parameters": ["mlp.experts.gate_proj"]},
            "target_parameters 'mlp.experts.gate_proj' is not supported",
        ),
        ({"target_modules": ["q_proj", "score"]}, "unknown target module 'score'"),
        ({"target_modules": "all-linear"}, "is a pattern"),
        ({"r": True}, "'r' must be a positive integer"),
        ({"layers_to_transform": "0"}, "layers_to_transform"),
    ],
)
def test_what_we_cannot_serve_is_refused(change, message):
    with pytest.raises(AdapterLoadError, match=message) as info:
        parse_adapter_config({**BASE, **change})
    assert info.value.kind == "invalid"


@pytest.fixture
def rooted(tmp_path: Path, adapter_dirs: dict[str, Path]) -> dict[str, Path]:
    root, outside = tmp_path / "root", tmp_path / "outside"
    shutil.copytree(adapter_dirs["a4"], root / "plain")
    shutil.copytree(adapter_dirs["a4"], outside)
    return {"root": root, "plain": root / "plain", "outside": outside}


def test_node0_refuses_weights_linked_outside_the_root(rooted):
    escaped = rooted["root"] / "escaped"
    escaped.mkdir()
    shutil.copy(rooted["plain"] / CONFIG_FILE, escaped / CONFIG_FILE)
    (escaped / SAFETENSORS).symlink_to(rooted["outside"] / SAFETENSORS)
    with pytest.raises(AdapterLoadError, match="resolves outside the allowed root") as info:
        read_adapter_dir(str(escaped), str(rooted["root"]), "esc")
    assert info.value.kind == "forbidden" and "adapter 'esc'" in str(info.value)
    config, specs, _ = read_adapter_dir(str(escaped), None)  # without a root, links are followed as before
    assert config["r"] == 4 and specs


def test_a_link_swapped_in_after_the_last_name_check_is_refused(rooted, monkeypatch):
    # The weight file is found by name inside the root; between that and the open, it becomes a link outside.
    weights = rooted["plain"] / SAFETENSORS
    found = AdapterFiles.weights_path

    def found_then_swapped(self: AdapterFiles, path: str) -> str:
        weights_path = found(self, path)
        weights.unlink()
        weights.symlink_to(rooted["outside"] / SAFETENSORS)
        return weights_path

    monkeypatch.setattr(AdapterFiles, "weights_path", found_then_swapped)
    with pytest.raises(AdapterLoadError, match="resolves outside the allowed root") as info:
        read_adapter_dir(str(rooted["plain"]), str(rooted["root"]), "swapped")
    assert info.value.kind == "forbidden"


def test_a_start_up_config_is_read_inside_the_root(rooted):
    assert read_adapter_config("a", str(rooted["plain"]), str(rooted["root"])).r == 4
    with pytest.raises(AdapterLoadError, match="outside the allowed root") as info:
        read_adapter_config("a", str(rooted["outside"]), str(rooted["root"]))
    assert info.value.kind == "forbidden"
