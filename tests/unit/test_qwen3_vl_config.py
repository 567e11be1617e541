"""Qwen3-VL's config.json read into ModelConfig (the transformers 5 form, rope_parameters in text_config, and the
published transformers 4.57 form, rope_scaling beside rope_theta, read alike; the tower's fields along), and its
interleaved M-RoPE (worker/layers/rotary.py) turning each frequency by the row transformers' rotary turns it by."""

from __future__ import annotations

import pytest
import torch
from loraplex.worker.layers.rotary import RotaryEmbedding
from loraplex.worker.model.config import ModelConfig, ModelConfigError

from tests.qwen3_vl_models import hf_config


def test_both_config_forms_read_alike() -> None:
    nested = hf_config().to_dict()
    old_text = {k: v for k, v in nested["text_config"].items() if k != "rope_parameters"}
    old = {**nested, "text_config": {**old_text, "rope_theta": 10000.0, "rope_scaling": {
        "rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}}}  # fmt: skip
    new, published = ModelConfig.from_dict(nested), ModelConfig.from_dict(old)
    assert new == published
    assert new.rope.params == {"mrope_section": [4, 2, 2], "mrope_interleaved": True}
    assert not new.qkv_bias and not new.o_bias and new.head_dim == 16  # Qwen3's attention: no biases
    vision = new.vision
    assert (vision.kind, vision.depth, vision.hidden_size, vision.out_hidden_size) == ("qwen3_vl", 3, 32, 64)
    assert vision.deepstack_indexes == (0, 1) and vision.num_position_embeddings == 16 and vision.patch_size == 16
    assert vision.image_token_id == nested["image_token_id"]


def test_a_vision_tower_of_another_activation_is_refused() -> None:
    config = hf_config().to_dict()
    config["vision_config"]["hidden_act"] = "silu"
    with pytest.raises(ModelConfigError, match="vision hidden_act 'silu'"):
        ModelConfig.from_dict(config)


def test_interleaved_mrope_equals_transformers() -> None:
    """Qwen3-VL-2B's rope (head_dim 128, sections 24/20/20 interleaved): per token, the cos and sin of our tables at
    three different position rows equal transformers' Qwen3VLTextRotaryEmbedding's."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    text = dict(hidden_size=2048, intermediate_size=64, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                num_hidden_layers=1, vocab_size=64, max_position_embeddings=4096, rope_parameters=rope)  # fmt: skip
    ours = RotaryEmbedding(128, 4096, ModelConfig.from_dict({**text, "model_type": "qwen3"}).rope)
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 4096, (3, 40), generator=generator)
    ref_cos, ref_sin = Qwen3VLTextRotaryEmbedding(Qwen3VLTextConfig(**text))(torch.zeros(1), positions[:, None, :])
    _, cos, sin = ours._mrope_tables(positions)
    assert torch.allclose(cos, ref_cos[0], atol=1e-6) and torch.allclose(sin, ref_sin[0], atol=1e-6)
    # not the runs of Qwen2.5-VL's sections: those turn these frequencies by other rows
    runs = RotaryEmbedding(128, 4096, ModelConfig.from_dict({**text, "model_type": "qwen3", "rope_parameters": {
        **rope, "mrope_interleaved": False}}).rope)  # fmt: skip
    assert not torch.allclose(runs._mrope_tables(positions)[1], ref_cos[0], atol=1e-3)
