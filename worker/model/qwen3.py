"""Qwen3: the Llama decoder with an RMSNorm over each head of q and of k before rotary, no qkv bias (unless
attention_bias), and head_dim from the config (q_size may differ from hidden)."""

from __future__ import annotations

import torch
from loraplex.worker.layers.attention_spec import LayerAttention
from loraplex.worker.layers.norm import RMSNorm
from loraplex.worker.layers.rotary import RotaryEmbedding
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from torch import nn


class Qwen3Attention(LlamaAttention):
    qk_norm_cls: type[nn.Module] = RMSNorm  # Gemma 3 norms its heads with its own (1 + w) RMSNorm

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer: LayerAttention):
        super().__init__(config, rotary, layer)
        # One weight of head_dim each, shared by every head (so replicated, not sharded, under TP).
        self.q_norm = self.qk_norm_cls(config.head_dim, config.rms_norm_eps)
        self.k_norm = self.qk_norm_cls(config.head_dim, config.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q (tokens, heads, head_dim), k (tokens, kv_heads, head_dim): normed as rows of head_dim (the norm ops take
        # 2-D input), then given back their head axis.
        q_normed = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k_normed = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return q_normed, k_normed


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
