"""Hybrid models' config.json forms read into ModelConfig: the multimodal Qwen3.5 wrapper (its text_config served),
layer_types absent (every full_attention_interval-th layer attends fully), --hf-overrides cutting layers, the state
dtype the checkpoint names, and the shared expert of the MoE types."""

from __future__ import annotations

import pytest
from loraplex.worker.model.config import ModelConfig, ModelConfigError, merge_overrides

TEXT = {  # Qwen3.5-shaped text config, with layer_types left to full_attention_interval
    "model_type": "qwen3_5_text", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "full_attention_interval": 4, "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32",
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}  # fmt: skip


def test_text_config_layers_from_the_interval():
    config = ModelConfig.from_dict(TEXT)
    la = config.linear_attention
    assert la.layer_ids == (0, 1, 2, 4, 5, 6) and config.attention_layer_ids == (3, 7)
    assert (la.key_dim, la.value_dim, la.conv_dim) == (128, 256, 512)
    assert la.state_dtype == "float32" and config.rope.rotary_dim(config.head_dim) == 16
    assert config.moe is None


def test_the_multimodal_wrapper_serves_its_text_config_and_overrides_reach_it():
    wrapped = {"model_type": "qwen3_5", "tie_word_embeddings": False, "vision_config": {"depth": 2},
               "text_config": {**TEXT, "model_type": "qwen3_5_text"}}  # fmt: skip
    config = ModelConfig.from_dict(merge_overrides(wrapped, {"num_hidden_layers": 4}))
    assert config.model_type == "qwen3_5" and config.num_layers == 4
    assert config.linear_attention.layer_ids == (0, 1, 2) and config.attention_layer_ids == (3,)


def test_moe_types_have_a_shared_expert_and_qwen3_next_its_dense_layers():
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
           "shared_expert_intermediate_size": 96}  # fmt: skip
    qwen3_5_moe = ModelConfig.from_dict({**TEXT, **moe, "model_type": "qwen3_5_moe_text"}).moe
    assert qwen3_5_moe.shared_intermediate_size == 96 and qwen3_5_moe.renormalize and not qwen3_5_moe.dense_layers
    nxt = ModelConfig.from_dict({**TEXT, **moe, "model_type": "qwen3_next", "mlp_only_layers": [1],
                                 "norm_topk_prob": True}).moe  # fmt: skip
    assert nxt.dense_layers == (1,) and nxt.renormalize


def test_bad_linear_heads_and_layer_types_are_refused():
    with pytest.raises(ModelConfigError, match="multiple"):
        ModelConfig.from_dict({**TEXT, "linear_num_value_heads": 6})
    with pytest.raises(ModelConfigError, match="layer_types"):
        ModelConfig.from_dict({**TEXT, "layer_types": ["linear_attention", "mamba"] * 4})
