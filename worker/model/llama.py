"""Llama-family decoder (Llama, Mistral, Qwen2) over flat token batches: hidden states are (tokens, hidden).

Layers are built with full (unsharded) sizes; the linear layers hold their own shard and report its sizes, which
is all the attention needs to know to split q/k/v. Other families reuse these classes: a subclass names its own
attention / MLP / layer / model class in the class attributes below and overrides `norm_qk` where it norms q and k."""

from __future__ import annotations

import torch
from loraplex.worker.kv_cache import KVCache, KVLayer
from loraplex.worker.layers.activation import SiluAndMul
from loraplex.worker.layers.attention import BatchAttention, paged_attention
from loraplex.worker.layers.attention_spec import LayerAttention
from loraplex.worker.layers.embedding import Embedding, LMHead
from loraplex.worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from loraplex.worker.layers.norm import RMSNorm
from loraplex.worker.layers.rotary import RotaryEmbedding
from loraplex.worker.model.config import ModelConfig
from torch import nn


def layer_attention(config: ModelConfig, layer_id: int) -> LayerAttention:
    """Layer `layer_id`'s softmax scale, sliding window or attention chunk, and logit cap, as the config sets them."""
    return LayerAttention(
        scale=config.attention_scale,
        sliding_window=config.layer_window(layer_id),
        logit_cap=config.attn_logit_softcap,
        chunk_size=config.layer_chunk(layer_id),
    )


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer: LayerAttention):
        super().__init__()
        self.head_dim = config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.qkv_proj = MergedColumnParallelLinear(config.hidden_size, [q_size, kv_size, kv_size], bias=config.qkv_bias)
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=config.o_bias)
        self.rotary = rotary
        self.layer = layer

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv: KVLayer,
        attention: BatchAttention,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # (tokens, q_size + 2 * kv_size) of this shard
        q, k, v = qkv.split(self.qkv_proj.output_sizes_per_rank, dim=-1)
        q = q.view(num_tokens, -1, self.head_dim)  # (tokens, heads, head_dim)
        k = k.view(num_tokens, -1, self.head_dim)  # (tokens, kv_heads, head_dim)
        v = v.view(num_tokens, -1, self.head_dim)
        q, k = self.norm_qk(q, k)
        q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v, kv[0], kv[1], attention, self.layer, kv.scales)  # (tokens, heads, head_dim)
        return self.o_proj(out.reshape(num_tokens, -1))  # (tokens, hidden)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Before rotary: nothing in Llama; a family with per-head q/k norms overrides it."""
        return q, k


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(hidden)  # (tokens, 2 * intermediate of this shard): [gate | up]
        return self.down_proj(self.act_fn(gate_up))  # (tokens, hidden)


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[nn.Module] = LlamaAttention
    mlp_cls: type[nn.Module] = LlamaMLP

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_cls(config, rotary, layer_attention(config, layer_id))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.mlp_cls(config)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv: KVLayer,
        attention: BatchAttention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried beside each block's output and added by the next norm (one fused op):
        returns (this layer's MLP output, the stream before it); the stream after it is their sum."""
        if residual is None:  # the first layer: the stream is the embeddings
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv, attention)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual  # (tokens, hidden) each


class LlamaModel(nn.Module):
    layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope)
        self.layers = nn.ModuleList(self.layer_cls(config, rotary, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, attention: BatchAttention
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # (tokens, hidden)
        for layer_id, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, kv_cache.layer(layer_id), attention)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    model_cls: type[nn.Module] = LlamaModel

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, max_positions)
        tied_to = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied_to)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, attention: BatchAttention
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_cache, attention)  # (tokens, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # (rows, vocab)
