"""Adapters on fused modules (qkv_proj, gate_up_proj; Phi-3's PEFT adapters): the config reads them as their slices,
the weights split per slice, and what does not fit is refused with a message that names it."""

from __future__ import annotations

import pytest
import torch
from loraplex.frontend.adapters.files import encode_tensors
from loraplex.protocol.adapters.adapter_config import AdapterLoadError, parse_adapter_config
from loraplex.protocol.adapters.lora_targets import LAYER_MODULES, TARGET_MODULES
from loraplex.worker.lora.adapter import PoolSpec, adapter_from_tensors
from loraplex.worker.model.config import ModelConfig

PHI3 = dict(model_type="phi3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
POOL = PoolSpec(max_lora_rank=8, target_modules=TARGET_MODULES, dtype=torch.float32, device=torch.device("cpu"))
PREFIX = "base_model.model.model.layers.0"


def _config(targets: list[str]) -> dict:
    return {"r": 2, "lora_alpha": 4, "target_modules": targets, "peft_type": "LORA"}


def test_fused_targets_read_as_their_slices() -> None:
    assert parse_adapter_config(_config(["gate_up_proj", "qkv_proj"])).target_modules == (
        "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # fmt: skip
    with pytest.raises(AdapterLoadError, match="both 'qkv_proj' and its slice 'k_proj'"):
        parse_adapter_config(_config(["qkv_proj", "k_proj"]))
    with pytest.raises(AdapterLoadError, match="unknown target module 'score'"):
        parse_adapter_config(_config(["qkv_proj", "score"]))


def test_fused_weights_split_per_slice() -> None:
    model = ModelConfig.from_dict(PHI3)  # q 32, k 16, v 16 rows; gate and up 48 each
    gen = torch.Generator().manual_seed(0)
    tensors = {
        f"{PREFIX}.self_attn.qkv_proj.lora_A.weight": torch.randn(2, 32, generator=gen),
        f"{PREFIX}.self_attn.qkv_proj.lora_B.weight": torch.randn(64, 2, generator=gen),
        f"{PREFIX}.mlp.gate_up_proj.lora_A.weight": torch.randn(2, 32, generator=gen),
        f"{PREFIX}.mlp.gate_up_proj.lora_B.weight": torch.randn(96, 2, generator=gen),
    }
    adapter = adapter_from_tensors(_config(["qkv_proj", "gate_up_proj"]), *encode_tensors(tensors), 1, model, POOL,
                                   0, 1)  # fmt: skip
    qkv_a, qkv_b = (tensors[f"{PREFIX}.self_attn.qkv_proj.lora_{which}.weight"] for which in "AB")
    for module, rows in (("q_proj", slice(0, 32)), ("k_proj", slice(32, 48)), ("v_proj", slice(48, 64))):
        lora_a, lora_b = adapter.weights[(0, module)]
        assert torch.equal(lora_a, qkv_a) and torch.equal(lora_b, qkv_b[rows]), module
    up_b = adapter.weights[(0, "up_proj")][1]
    assert torch.equal(up_b, tensors[f"{PREFIX}.mlp.gate_up_proj.lora_B.weight"][48:])


def test_fused_b_of_the_wrong_size_is_refused() -> None:
    model = ModelConfig.from_dict(PHI3)
    tensors = {
        f"{PREFIX}.self_attn.qkv_proj.lora_A.weight": torch.zeros(2, 32),
        f"{PREFIX}.self_attn.qkv_proj.lora_B.weight": torch.zeros(96, 2),  # q|k|v of full MHA: not this model's
    }
    with pytest.raises(AdapterLoadError, match=r"qkv_proj fuses q_proj\+k_proj\+v_proj: 32\+16\+16 outputs"):
        adapter_from_tensors(_config(["qkv_proj"]), *encode_tensors(tensors), 1, model, POOL, 0, 1)


def test_the_embedding_and_head_are_pool_targets_by_name_only() -> None:
    from loraplex.protocol.config import ServerConfig

    # "all": every decoder-layer linear of any family (a worker's pool keeps those its model has)
    assert ServerConfig(lora_target_modules=["all"]).target_modules == LAYER_MODULES
    both = ServerConfig(lora_target_modules=["lm_head", "all", "embed_tokens"]).target_modules
    assert both == (*LAYER_MODULES, "embed_tokens", "lm_head")
    assert parse_adapter_config(_config(["lm_head", "qkv_proj"])).target_modules == ("q_proj", "k_proj", "v_proj",
                                                                                     "lm_head")  # fmt: skip
