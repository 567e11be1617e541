"""Qwen2.5-VL's config.json read into ModelConfig: the transformers 5 form (text_config, rope_parameters with
mrope_section) and the transformers 4 form (the language model's fields at the top level, rope_scaling of type
mrope) give the same model; the vision tower's fields and the placeholder token come along."""

from __future__ import annotations

import pytest
from loraplex.worker.model.config import ModelConfig, ModelConfigError

from tests.vision_models import hf_config


def test_both_config_forms_read_alike() -> None:
    nested = hf_config().to_dict()
    text = nested["text_config"]
    flat = {**{k: v for k, v in nested.items() if k != "text_config"}, **text, "model_type": "qwen2_5_vl",
            "rope_theta": 10000.0, "rope_scaling": {"type": "mrope", "mrope_section": [4, 2, 2]}}  # fmt: skip
    flat.pop("rope_parameters")
    new, old = ModelConfig.from_dict(nested), ModelConfig.from_dict(flat)
    assert new == old
    assert new.rope.rope_type == "default" and new.rope.params["mrope_section"] == [4, 2, 2]
    assert new.qkv_bias and not new.o_bias  # Qwen2's biases
    assert (new.num_layers, new.hidden_size, new.vocab_size) == (2, 64, text["vocab_size"])
    vision = new.vision
    assert (vision.depth, vision.hidden_size, vision.num_heads, vision.out_hidden_size) == (2, 32, 2, 64)
    assert vision.fullatt_block_indexes == (1,) and vision.window_size == 16
    assert vision.image_token_id == nested["image_token_id"]


def test_a_vision_tower_of_another_activation_is_refused() -> None:
    config = hf_config().to_dict()
    config["vision_config"]["hidden_act"] = "gelu"
    with pytest.raises(ModelConfigError, match="vision hidden_act 'gelu'"):
        ModelConfig.from_dict(config)
