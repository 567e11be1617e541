"""The hybrid families at their flagship models' widths: transformers' config classes say their defaults are
Qwen3-Next-80B-A3B's, Qwen3.5-27B's and Qwen3.5-35B-A3B's (no published config.json is shipped: docs/MODELS.md).
Each starts with `--load-format dummy` and overrides that cut layers, experts and vocabulary as `--hf-overrides` cuts
them (hidden size, heads and head dims stay the published ones), draws every parameter and decodes finite logits
through both layer kinds, its state slot written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from loraplex.protocol.structs import ForwardReq, SamplingParams
from transformers import Qwen3NextConfig
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

from tests.worker_helpers import make_runner

CUT = {"num_hidden_layers": 4, "vocab_size": 512}  # layers 0-2 linear attention, layer 3 full (the interval of 4)
MOE_CUT = {"num_experts": 8, "num_experts_per_tok": 2}
CONFIGS = {
    "Qwen3-Next-80B-A3B": (Qwen3NextConfig, MOE_CUT),
    "Qwen3.5-27B": (Qwen3_5TextConfig, {"intermediate_size": 512}),
    "Qwen3.5-35B-A3B": (Qwen3_5MoeTextConfig, MOE_CUT),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_dummy_weights_at_published_widths_with_fewer_layers(name: str, tmp_path: Path) -> None:
    config_cls, cut = CONFIGS[name]
    published = config_cls()
    model_dir = tmp_path / name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(published.to_dict()))
    runner = make_runner(model_dir, load_format="dummy", hf_overrides={**CUT, **cut}, max_running_requests=2)
    config, la = runner.model_config, runner.model_config.linear_attention
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        published.hidden_size,
        published.num_attention_heads,
        published.num_key_value_heads,
        published.head_dim,
    )
    assert (la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel_size) == (
        published.linear_num_value_heads, published.linear_key_head_dim, published.linear_value_head_dim,
        published.linear_conv_kernel_dim)  # fmt: skip
    assert la.layer_ids == (0, 1, 2) and config.attention_layer_ids == (3,)
    cache = runner.kv_cache
    assert cache.recurrent.abs().sum() == 0
    prompt = [1, 2, 3, 4, 5, 6, 7]
    req = ForwardReq(input_ids=prompt, num_cached_tokens=0, page_ids=[0, 1], sampling=SamplingParams(), state_slot=1)
    with torch.inference_mode():
        logits = runner.logits([req], [], last_only=False)
    assert logits.shape == (len(prompt), 512) and torch.isfinite(logits).all()
    written = cache.recurrent[:, 1].abs().sum(dim=(1, 2, 3))  # every linear layer's state of slot 1, none other
    assert (written > 0).all() and cache.recurrent[:, 0].abs().sum() == 0
