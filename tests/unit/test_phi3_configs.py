"""The real config.json files of microsoft/Phi-4-mini-instruct and microsoft/Phi-3-mini-4k-instruct (tests/data),
read as ModelConfig and as transformers reads them: shapes, partial rotary, longrope, and the rope tables."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from loraplex.worker.layers.rotary import RotaryEmbedding
from loraplex.worker.lora.targets import full_shapes
from loraplex.worker.model.config import ModelConfig
from transformers import Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"


def _read(name: str) -> tuple[dict, ModelConfig]:
    raw = json.loads((CONFIGS / name / "config.json").read_text())
    return raw, ModelConfig.from_dict(raw)


def test_phi4_mini_instruct() -> None:
    raw, config = _read("Phi-4-mini-instruct")
    assert (config.model_type, config.num_layers, config.hidden_size, config.intermediate_size) == ("phi3", 32, 3072,
                                                                                                   8192)  # fmt: skip
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (24, 8, 128, 200064)
    assert config.tie_word_embeddings and not (config.qkv_bias or config.o_bias or config.mlp_bias)
    rope = config.rope
    assert rope.rope_type == "longrope" and rope.rotary_dim(config.head_dim) == 96
    assert rope.params["original_max_position_embeddings"] == 4096 and rope.max_position_embeddings == 131072
    assert len(rope.params["long_factor"]) == len(rope.params["short_factor"]) == 48
    # As published: plain RoPE up to 4096 tokens, scaled factors past it. Were the two lists equal, the comparisons
    # below could not tell the short rows from the long ones, and a swap of the two would pass.
    assert rope.params["short_factor"] == [1.0] * 48 and rope.params["long_factor"][-1] == 47.77
    # The fused layers' slices: q 24 heads, k and v 8 heads each, of 128
    assert full_shapes(config)["q_proj"] == (3072, 3072) and full_shapes(config)["k_proj"] == (3072, 1024)
    # The short rows (a sequence of at most 4096 tokens) and the long ones (a longer sequence) as transformers'
    max_positions = 4200
    rotary = RotaryEmbedding(config.head_dim, max_positions, rope)
    hf = Phi3RotaryEmbedding(config=Phi3Config(**raw))
    for position in (0, 1, 4095):
        cos, sin = hf(torch.zeros(1), torch.tensor([[position]]))  # sequence length position + 1
        assert torch.equal(rotary.cos[position], cos[0, 0]) and torch.equal(rotary.sin[position], sin[0, 0])
    for position in (0, 4095, 4096, 4199):
        cos, sin = hf(torch.zeros(1), torch.tensor([[position, 4199]]))  # sequence length 4200
        row = max_positions + position
        assert torch.equal(rotary.cos[row], cos[0, 0]) and torch.equal(rotary.sin[row], sin[0, 0])
    assert not torch.allclose(rotary.cos[4095], rotary.cos[max_positions + 4095])  # the two sets of rows differ


def test_phi3_mini_4k_instruct() -> None:
    raw, config = _read("Phi-3-mini-4k-instruct")
    assert (config.model_type, config.num_layers, config.num_heads, config.num_kv_heads) == ("phi3", 32, 32, 32)
    assert (config.head_dim, config.vocab_size, config.max_position_embeddings) == (96, 32064, 4096)
    assert not config.tie_word_embeddings
    assert config.rope.rope_type == "default" and config.rope.rotary_dim(config.head_dim) == 96
    rotary = RotaryEmbedding(config.head_dim, 64, config.rope)
    cos, sin = Phi3RotaryEmbedding(config=Phi3Config(**raw))(torch.zeros(1), torch.arange(64)[None])
    assert torch.equal(rotary.cos, cos[0]) and torch.equal(rotary.sin, sin[0])
