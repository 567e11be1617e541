"""GLM-4.5 / 4.6 (model_type glm4_moe): DeepSeek-V3's MoE with ordinary grouped-query attention.

Attention is Llama's with three changes: biases on q, k and v (attention_bias; never on o_proj), rotary over the
leading partial_rotary_factor of each head only (0.5 by default: the rest of each q and k head passes through
unrotated, in rotate-half layout), and, where use_qk_norm says so, Qwen3's RMSNorm over each head of q and of k before
rotary. The MLPs are DeepSeek-V3's: the first `first_k_dense_replace` layers dense, the others a sigmoid router with
the correction bias choosing top-k experts within the best groups (weights renormalised when norm_topk_prob, scaled by
routed_scaling_factor), plus the shared experts' one MLP of moe_intermediate_size * n_shared_experts. The checkpoints'
multi-token-prediction layer (model.layers.<num_hidden_layers>) is not served: worker/loader.py skips layers beyond
the model's."""

from __future__ import annotations

from loraplex.worker.layers.attention_spec import LayerAttention
from loraplex.worker.layers.rotary import RotaryEmbedding
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.deepseek_v3 import DeepseekV3MoE
from loraplex.worker.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from loraplex.worker.model.qwen3 import Qwen3Attention
from torch import nn


def glm4_moe_attention(config: ModelConfig, rotary: RotaryEmbedding, layer: LayerAttention) -> nn.Module:
    """Qwen3's attention (per-head q/k RMSNorms) where use_qk_norm says so (GLM-4.5), Llama's elsewhere (4.5-Air)."""
    return (Qwen3Attention if config.qk_norm else LlamaAttention)(config, rotary, layer)


class Glm4MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = staticmethod(glm4_moe_attention)
    mlp_cls = DeepseekV3MoE


class Glm4MoeModel(LlamaModel):
    layer_cls = Glm4MoeDecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__(config, max_positions)
        for layer_id in config.moe.dense_layers:  # the first first_k_dense_replace layers
            self.layers[layer_id].mlp = LlamaMLP(config)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    model_cls = Glm4MoeModel
