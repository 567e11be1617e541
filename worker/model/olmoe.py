"""OLMoE: the Llama decoder with RMSNorms over the whole q and k projections (not per head) before rotary, and a
sparse MoE block whose top-k weights are not renormalised (norm_topk_prob false in the published models)."""

from __future__ import annotations

import torch
from loraplex.worker.layers.attention_spec import LayerAttention
from loraplex.worker.layers.rotary import RotaryEmbedding
from loraplex.worker.layers.sharded_norm import ShardedRMSNorm
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from loraplex.worker.model.mixtral import MoEMLP


class OlmoeAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer: LayerAttention):
        super().__init__(config, rotary, layer)
        # Over all heads of the projection, which TP splits: the norm sums its statistics over the ranks.
        self.q_norm = ShardedRMSNorm(config.num_heads * config.head_dim, config.rms_norm_eps)
        self.k_norm = ShardedRMSNorm(config.num_kv_heads * config.head_dim, config.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q (tokens, heads, head_dim), k (tokens, kv_heads, head_dim): normed as (tokens, heads * head_dim) rows
        num_tokens = q.shape[0]
        q_normed = self.q_norm(q.reshape(num_tokens, -1)).view(q.shape)
        k_normed = self.k_norm(k.reshape(num_tokens, -1)).view(k.shape)
        return q_normed, k_normed


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = OlmoeAttention
    mlp_cls = MoEMLP


class OlmoeModel(LlamaModel):
    layer_cls = OlmoeDecoderLayer


class OlmoeForCausalLM(LlamaForCausalLM):
    model_cls = OlmoeModel
