"""DeepSeek-V3 config.json as the worker reads it: the reference's defaults where a key is absent, its softmax scale
(yarn's mscale_all_dim squared), the router it runs, and the latent cache's layout."""

from __future__ import annotations

import pytest
from loraplex.worker.model.config import ModelConfig, ModelConfigError

from tests.mla_models import hf_config


def test_softmax_scale_and_layout_match_the_reference() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    for rope in (None, dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=128,
                            beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)):
        hf = hf_config(**({"rope_parameters": rope} if rope else {"rope_parameters": {"rope_type": "default",
                                                                                     "rope_theta": 10000.0}}))
        config = ModelConfig.from_dict(hf.to_dict())
        assert config.mla.softmax_scale == pytest.approx(DeepseekV3Attention(hf, 0).scaling, rel=1e-12)
        assert config.kv_layout(world_size=2) == (1, 1, 32 + 8)  # one head of latent + rope key, on every rank
        assert config.head_dim == 8  # rotary runs over the rope part


def test_absent_keys_take_the_reference_defaults_and_null_stays_null() -> None:
    hf = hf_config().to_dict()
    for key in ("q_lora_rank", "norm_topk_prob", "n_group", "topk_group", "rope_interleave"):
        del hf[key]
    hf["n_routed_experts"] = 16  # divisible by the default 8 groups
    config = ModelConfig.from_dict(hf)
    assert config.mla.q_lora_rank == 1536 and config.mla.rope_interleave
    assert (config.moe.renormalize, config.moe.num_groups, config.moe.topk_group) == (True, 8, 4)
    assert ModelConfig.from_dict({**hf, "q_lora_rank": None}).mla.q_lora_rank is None


@pytest.mark.parametrize("change", [{"scoring_func": "softmax"}, {"topk_method": "greedy"}, {"moe_layer_freq": 2},
                                    {"n_group": 3}])
def test_other_routers_are_refused(change: dict) -> None:
    with pytest.raises(ModelConfigError):
        ModelConfig.from_dict({**hf_config().to_dict(), **change})


@pytest.mark.parametrize("groups", [(4, 2), (1, 1)])  # DeepSeek-V3's grouped choice; Kimi K2's one group
def test_router_matches_the_reference(groups: tuple[int, int]) -> None:
    import torch
    from loraplex.worker.layers.moe import route_grouped
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    n_group, topk_group = groups
    hf = hf_config(n_group=n_group, topk_group=topk_group)
    router = DeepseekV3TopkRouter(hf)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
        router.e_score_correction_bias.copy_(torch.randn(8, generator=generator))
    hidden = torch.randn(32, hf.hidden_size, generator=generator)
    _, ref_weights, ref_ids = router(hidden)
    weights, ids = route_grouped(hidden @ router.weight.T, router.e_score_correction_bias, hf.num_experts_per_tok,
                                 n_group, topk_group, True, hf.routed_scaling_factor)  # fmt: skip
    order, ref_order = ids.sort(dim=-1), ref_ids.sort(dim=-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices))
