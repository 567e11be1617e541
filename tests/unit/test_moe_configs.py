"""The published config.json of one model per MoE family (tests/data/model_configs/) read into ModelConfig: the
experts, routing and dense layers each family's HF model class reads from it."""

from __future__ import annotations

from pathlib import Path

import pytest
from loraplex.worker.model.config import ModelConfig, ModelConfigError, MoEConfig

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "data" / "model_configs"

# model -> (model_type, layers, hidden, heads, kv heads, head_dim, MoE fields, rope theta)
EXPECTED = {
    "Mixtral-8x7B-v0.1": ("mixtral", 32, 4096, 32, 8, 128, MoEConfig(8, 2, 14336, renormalize=True), 1e6),
    "OLMoE-1B-7B-0924": ("olmoe", 16, 2048, 16, 16, 128, MoEConfig(64, 8, 1024, renormalize=False), 1e4),
    "Qwen3-30B-A3B": ("qwen3_moe", 48, 2048, 32, 4, 128, MoEConfig(128, 8, 768, renormalize=True), 1e6),
}


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_published_moe_configs_are_read(model: str) -> None:
    config = ModelConfig.from_dir(str(CONFIGS_DIR / model))
    model_type, layers, hidden, heads, kv_heads, head_dim, moe, theta = EXPECTED[model]
    assert (config.model_type, config.num_layers, config.hidden_size) == (model_type, layers, hidden)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (heads, kv_heads, head_dim)
    assert config.moe == moe and config.rope.theta == theta and config.sliding_window is None


def test_the_published_configs_agree_with_transformers() -> None:
    from transformers import AutoConfig

    for model in EXPECTED:
        hf = AutoConfig.from_pretrained(CONFIGS_DIR / model)
        moe = ModelConfig.from_dir(str(CONFIGS_DIR / model)).moe
        num_experts = getattr(hf, "num_local_experts", None) or hf.num_experts
        inter = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
        assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (num_experts, hf.num_experts_per_tok, inter)


def test_qwen3_moe_dense_layers_follow_mlp_only_layers_and_the_sparse_step() -> None:
    base = {"model_type": "qwen3_moe", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 6, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 4}  # fmt: skip
    assert ModelConfig.from_dict(base).moe.dense_layers == ()
    assert ModelConfig.from_dict({**base, "mlp_only_layers": [0, 4]}).moe.dense_layers == (0, 4)
    # Qwen3MoeDecoderLayer: sparse where (layer + 1) % decoder_sparse_step == 0
    assert ModelConfig.from_dict({**base, "decoder_sparse_step": 2}).moe.dense_layers == (0, 2, 4)
    assert ModelConfig.from_dict({**base, "norm_topk_prob": True}).moe.renormalize


def test_olmoe_qkv_clipping_is_refused() -> None:
    base = {"model_type": "olmoe", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2}
    assert ModelConfig.from_dict(base).moe.renormalize is False
    with pytest.raises(ModelConfigError, match="clip_qkv"):
        ModelConfig.from_dict({**base, "clip_qkv": 8.0})


def test_gpt_oss_config_is_read_as_transformers_builds_the_model() -> None:
    """transformers' GptOssConfig defaults (not a published config.json): sinks, windows of 128 on every other layer
    from the first, yarn x32, the clamped SwiGLU; an override shortening the model keeps its first layer_types."""
    from transformers import GptOssConfig

    hf = GptOssConfig().to_dict()
    config = ModelConfig.from_dict(hf)
    assert config.attention_sinks and (config.qkv_bias, config.o_bias) == (True, True)
    assert config.layer_windows[:4] == (128, None, 128, None) and len(config.layer_windows) == hf["num_hidden_layers"]
    assert (config.rope.rope_type, config.rope.params["factor"], config.rope.theta) == ("yarn", 32.0, 150000.0)
    assert config.moe == MoEConfig(hf["num_local_experts"], 4, 2880, renormalize=False, swiglu_limit=7.0,
                                   swiglu_alpha=1.702, gate_up_interleaved=True)  # fmt: skip
    short = ModelConfig.from_dict({**hf, "num_hidden_layers": 3})
    assert short.layer_windows == (128, None, 128)
