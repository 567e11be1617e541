"""RoPE tables (worker/layers/rotary.py) against transformers' rotary embeddings: each scaling type, read from the
HF config as ModelConfig reads it, must give the cos/sin transformers gives a decode step at every position."""

from __future__ import annotations

import math

import pytest
import torch
from loraplex.worker.layers.ops import TorchOps
from loraplex.worker.layers.rotary import RotaryEmbedding
from loraplex.worker.model.config import ModelConfig
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

MAX_POSITIONS = 96
LLAMA = dict(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=MAX_POSITIONS)  # fmt: skip
HEAD_DIM = 32
# 3 frequencies of a head of 32 rotated by 0.75 -> 12 pairs
LONG = [1.0 + 0.37 * i for i in range(12)]
SHORT = [1.0 + 0.05 * i for i in range(12)]

CONFIGS = {
    "default": LlamaConfig(**LLAMA, rope_theta=10000.0),
    "linear": LlamaConfig(**LLAMA, rope_scaling={"rope_type": "linear", "factor": 2.5, "rope_theta": 5e5}),
    "dynamic": LlamaConfig(**LLAMA, rope_scaling={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}),
    "llama3": LlamaConfig(**LLAMA, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                                                 "rope_theta": 5e5}),  # fmt: skip
    "yarn": LlamaConfig(**LLAMA, rope_scaling={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                               "original_max_position_embeddings": 24}),  # fmt: skip
    "yarn_mscale": LlamaConfig(**LLAMA, rope_scaling={"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e4,
                                                      "original_max_position_embeddings": 12, "mscale": 0.7,
                                                      "mscale_all_dim": 0.9, "beta_fast": 16, "beta_slow": 2,
                                                      "truncate": False}),  # fmt: skip
    # Phi-4-mini's form: partial rotary, longrope with the original length at the top level
    "longrope": Phi3Config(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=MAX_POSITIONS,
                           original_max_position_embeddings=20, partial_rotary_factor=0.75,
                           rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
                           pad_token_id=0),  # fmt: skip
}


def _hf_rotary(name: str):
    config = CONFIGS[name]
    return (Phi3RotaryEmbedding if name == "longrope" else LlamaRotaryEmbedding)(config=config)


@pytest.mark.parametrize("name", [name for name in CONFIGS if name != "longrope"])
def test_tables_equal_transformers_decode_steps(name: str) -> None:
    ours = ModelConfig.from_dict(CONFIGS[name].to_dict())
    rotary = RotaryEmbedding(ours.head_dim, MAX_POSITIONS, ours.rope)
    assert rotary.cos.shape == (MAX_POSITIONS, ours.head_dim)
    hf = _hf_rotary(name)
    x = torch.zeros(1, dtype=torch.float32)
    for position in range(MAX_POSITIONS):
        # a decode step at `position`: transformers picks its scaling for the sequence length position + 1
        cos, sin = hf(x, torch.arange(position + 1)[None])
        assert torch.equal(rotary.cos[position], cos[0, -1]), (name, position)
        assert torch.equal(rotary.sin[position], sin[0, -1]), (name, position)


def test_longrope_tables_hold_the_short_then_the_long_rows_of_transformers() -> None:
    ours = ModelConfig.from_dict(CONFIGS["longrope"].to_dict()).rope
    assert ours.rope_type == "longrope" and ours.rotary_dim(HEAD_DIM) == 24
    original = ours.params["original_max_position_embeddings"]
    assert original == 20
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITIONS, ours)
    assert rotary.cos.shape == (2 * MAX_POSITIONS, 24)
    x = torch.zeros(1, dtype=torch.float32)
    # a sequence of at most `original` tokens: the short factors at each of its positions
    short_cos, short_sin = _hf_rotary("longrope")(x, torch.arange(original)[None])
    assert torch.equal(rotary.cos[:original], short_cos[0]) and torch.equal(rotary.sin[:original], short_sin[0])
    # a longer one: the long factors at every position, the first ones too
    long_cos, long_sin = _hf_rotary("longrope")(x, torch.arange(MAX_POSITIONS)[None])
    assert torch.equal(rotary.cos[MAX_POSITIONS:], long_cos[0]) and torch.equal(rotary.sin[MAX_POSITIONS:], long_sin[0])
    assert not torch.allclose(rotary.cos[:original], rotary.cos[MAX_POSITIONS : MAX_POSITIONS + original])
    # both scaled by the attention factor of max / original = 4.8
    factor = (1 + math.log(MAX_POSITIONS / original) / math.log(original)) ** 0.5
    assert torch.allclose(rotary.cos[0], torch.full((24,), factor))


def test_partial_rotary_rotates_the_leading_features_as_transformers() -> None:
    config = CONFIGS["longrope"]
    ours = ModelConfig.from_dict(config.to_dict())
    rotary = RotaryEmbedding(ours.head_dim, MAX_POSITIONS, ours.rope)
    rotary.ops = TorchOps()
    gen = torch.Generator().manual_seed(0)
    num_tokens = 7
    q = torch.randn(num_tokens, 2, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, 1, HEAD_DIM, generator=gen)
    positions = torch.tensor([0, 3, 5, 19, 20, 40, 95])
    ours_q, ours_k = rotary(positions, q.clone(), k.clone())
    # transformers' own rotation (the tables are checked against its rows above), heads before tokens
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        rotary.cos[positions][None], rotary.sin[positions][None])  # fmt: skip
    torch.testing.assert_close(ours_q, ref_q[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(ours_k, ref_k[0].transpose(0, 1), rtol=0, atol=0)
    assert torch.equal(ours_q[..., 24:], q[..., 24:])  # the pass-through features


@pytest.mark.parametrize(
    "rope, message",
    [
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "short_factor has 1 values"),
        ({"rope_type": "longrope", "long_factor": LONG}, "missing short_factor"),
        ({"rope_type": "dynamic"}, "missing factor"),
        ({"rope_type": "mrope"}, "unsupported rope scaling type 'mrope'"),
    ],
)
def test_bad_rope_configs_fail_clearly(rope: dict, message: str) -> None:
    hf = {**LLAMA, "model_type": "llama", "rope_scaling": rope, "partial_rotary_factor": 0.75}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(hf)
