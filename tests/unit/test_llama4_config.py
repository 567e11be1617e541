"""Llama 4 config.json as the worker reads it: Llama4TextConfig's defaults and derived lists where keys are absent,
the layer kinds of both published patterns (every layer MoE; MoE every other layer), a multimodal config's
text_config, --hf-overrides cutting the layers, and refusals."""

from __future__ import annotations

import pytest
from loraplex.worker.model.config import ModelConfig, ModelConfigError, merge_overrides

from tests.llama4_models import hf_config


def test_absent_keys_take_the_reference_defaults() -> None:
    config = ModelConfig.from_dict({"model_type": "llama4_text"})
    assert (config.num_layers, config.hidden_size, config.num_heads, config.head_dim) == (48, 5120, 40, 128)
    assert config.nope_layers == tuple(range(3, 48, 4))  # a NoPE layer every fourth
    assert config.layer_chunks == tuple(None if (i + 1) % 4 == 0 else 8192 for i in range(48))
    assert config.moe.num_experts == 16 and config.moe.top_k == 1 and config.moe.dense_layers == ()
    assert config.intermediate_size == 16_384 and config.moe.intermediate_size == 8192
    assert config.rope.theta == 500_000.0 and config.attn_temperature == (8192.0, 0.1) and config.qk_l2_norm


def test_moe_every_other_layer_without_qk_norm_as_the_reference_builds_it() -> None:
    from transformers.models.llama4.modeling_llama4 import Llama4TextDecoderLayer

    hf = hf_config(num_hidden_layers=6, interleave_moe_layer_step=2, use_qk_norm=False, no_rope_layers=None)
    config = ModelConfig.from_dict(hf.to_dict())
    dense = tuple(i for i in range(6) if not Llama4TextDecoderLayer(hf, i).is_moe_layer)
    assert config.moe.dense_layers == dense == (0, 2, 4) and not config.qk_l2_norm
    assert config.nope_layers == (3,)


def test_multimodal_config_reads_its_text_config_and_overrides_cut_the_layers() -> None:
    from transformers import Llama4Config

    hf = Llama4Config(text_config=hf_config().to_dict()).to_dict()
    hf["dtype"] = "bfloat16"
    config = ModelConfig.from_dict(merge_overrides(hf, {"num_hidden_layers": 2}))
    assert config.model_type == "llama4" and config.num_layers == 2 and config.checkpoint_dtype == "bfloat16"
    assert config.layer_chunks == (6, None) and config.nope_layers == (1,) and config.moe.dense_layers == (0,)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attention_chunk_size": None}, "attention_chunk_size"),
        ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_refusals(overrides: dict, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict({**hf_config().to_dict(), **overrides})
