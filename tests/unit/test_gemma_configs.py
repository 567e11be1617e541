"""The shipped real config.json files of Gemma 2 and Gemma 3 (tests/data/model_configs/) read by ModelConfig as
transformers reads them: per-layer windows, ropes, soft-caps and shapes; a multimodal gemma3 through its text_config."""

from __future__ import annotations

from pathlib import Path

import pytest
from loraplex.worker.model.config import ModelConfig, ModelConfigError
from transformers import AutoConfig

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"
GEMMA_NAMES = ("gemma-2-2b", "gemma-3-1b-it", "gemma-3-4b-it")


@pytest.mark.parametrize("name", GEMMA_NAMES)
def test_shipped_gemma_config_reads_as_transformers_does(name: str) -> None:
    ours = ModelConfig.from_dir(str(CONFIGS / name))
    hf = AutoConfig.from_pretrained(CONFIGS / name)
    text = getattr(hf, "text_config", hf)
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size, ours.num_layers) == (
        text.vocab_size, text.hidden_size, text.intermediate_size, text.num_hidden_layers)  # fmt: skip
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        text.num_attention_heads, text.num_key_value_heads, text.head_dim)  # fmt: skip
    assert ours.max_context_length == text.max_position_embeddings and ours.tie_word_embeddings
    assert ours.hidden_act == text.hidden_activation == "gelu_pytorch_tanh"
    assert ours.attention_scale == text.query_pre_attn_scalar**-0.5
    assert ours.attn_logit_softcap == text.attn_logit_softcapping
    assert ours.final_logit_softcap == text.final_logit_softcapping
    windows = tuple(text.sliding_window if kind == "sliding_attention" else None for kind in text.layer_types)
    assert ours.layer_windows == windows and None in windows and text.sliding_window in windows
    ropes = text.rope_parameters
    global_rope = ropes.get("full_attention", ropes)
    assert ours.rope.theta == global_rope["rope_theta"] and ours.rope.rope_type == global_rope["rope_type"]
    assert ours.rope.params == {k: v for k, v in global_rope.items() if k not in ("rope_theta", "rope_type")}
    if "sliding_attention" in ropes:  # Gemma 3: the local layers' own base
        assert ours.local_rope.theta == ropes["sliding_attention"]["rope_theta"]
        assert ours.local_rope.rope_type == "default"
    else:
        assert ours.local_rope is None


def test_gemma3_multimodal_needs_its_text_config() -> None:
    with pytest.raises(ModelConfigError, match="text_config"):
        ModelConfig.from_dict({"model_type": "gemma3", "vision_config": {}})
