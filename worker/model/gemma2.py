"""Gemma 2 decoder over flat token batches: Llama's attention and fused linears, with Gemma's pieces around them.

Embeddings scaled by sqrt(hidden) (rounded to the activation dtype, as HF does), `(1 + w)` RMSNorms before and after
both the attention and the feed-forward block, GeGLU with tanh GELU, softmax scale query_pre_attn_scalar ** -0.5,
attention and final logit soft-capping, and local sliding-window layers interleaved with global ones (the config's
per-layer windows). Gemma 3 (gemma3.py) adds per-head q/k norms and the local layers' own rope base."""

from __future__ import annotations

import torch
from loraplex.worker.kv_cache import KVCache
from loraplex.worker.layers.activation import GeluTanhAndMul
from loraplex.worker.layers.attention import BatchAttention
from loraplex.worker.layers.embedding import Embedding
from loraplex.worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from loraplex.worker.layers.norm import GemmaRMSNorm
from loraplex.worker.layers.rotary import RotaryEmbedding
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.llama import LlamaAttention, LlamaForCausalLM, layer_attention
from torch import nn


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=False)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False)
        self.act_fn = GeluTanhAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden)))  # (tokens, hidden)


class Gemma2DecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer_id: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = self.attention_cls(config, rotary, layer_attention(config, layer_id))
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GemmaMLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv: tuple[torch.Tensor, torch.Tensor],
        attention: BatchAttention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer: (this layer's post-feed-forward-normed output, the stream before it)."""
        if residual is None:  # the first layer: the stream is the embeddings
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv, attention))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual  # (tokens, hidden) each


class Gemma2Model(nn.Module):
    layer_cls: type[Gemma2DecoderLayer] = Gemma2DecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        # In the activation dtype (the default dtype while the model is built): HF rounds sqrt(hidden) to it too.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        global_rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope)
        local_rotary = global_rotary
        if config.local_rope is not None:
            local_rotary = RotaryEmbedding(config.head_dim, max_positions, config.local_rope)
        self.layers = nn.ModuleList(
            self.layer_cls(config, global_rotary if config.layer_window(i) is None else local_rotary, i)
            for i in range(config.num_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, attention: BatchAttention
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids) * self.embed_scale, None  # (tokens, hidden)
        for layer_id, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, kv_cache.layer(layer_id), attention)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_cls = Gemma2Model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # (rows, vocab), capped in the activation dtype as the reference caps
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
