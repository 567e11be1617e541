"""Gemma 4's language model (`gemma4_text`, and the multimodal `gemma4` checkpoint's): Gemma 3's decoder
(gemma3.py) with

- norms that store their scale itself (Gemma4RMSNorm), a weightless RMSNorm over each value head, softmax scale 1;
- full-attention layers with their own head width and KV heads (ModelConfig.gemma4), rotated by `proportional` rope
  (the first quarter of the frequencies, the rest zero); with attention_k_eq_v their values are the keys' projection,
  normed as values;
- KV sharing: the last num_kv_shared_layers layers project queries alone and attend over the cache of the last earlier
  layer of their kind, which wrote this forward's tokens before them (the cache has no pages of theirs);
- per-layer inputs (PLE): a second embedding of every token, one slice per layer, added to a normed projection of the
  token's embedding; each layer gates its slice with its output and adds it back through a projection and a norm;
- a scalar per layer that multiplies the stream the layer leaves;
- MoE (enable_moe_block): every layer's dense MLP (`mlp.*`, here `mlp.shared_experts.*`) runs beside top-k experts
  (`experts.*`, here `mlp.experts.*`, GeGLU) whose router reads the stream before the feed-forward norm (RMS-normed
  without weight, times `scale`), and whose input has a norm of its own; the two outputs are normed apart and summed.

The paged cache gives every token a slot as wide as the widest layer's keys; a narrower layer views the leading part
(ModelConfig.kv_layout). A multimodal checkpoint's vision tower and embedder (gemma4_vision.py) encode its images,
whose soft tokens replace their placeholder tokens' embeddings (already scaled: the text embedding's scale is not
applied to them) and whose per-layer inputs take the pad token's slice, as transformers' Gemma4Model builds them; the
audio tower and embedder are not loaded (an audio part is refused by the API). With use_bidirectional_attention
"vision" the sliding layers let an image's tokens see its whole run (worker/image_blocks.py). The per-layer-input
linears are no LoRA targets."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loraplex.worker.image_blocks import ImageBlock, attend_image_blocks
from loraplex.worker.kv_cache import KVCache
from loraplex.worker.layers.activation import GeluTanhAndMul
from loraplex.worker.layers.attention import BatchAttention, paged_attention
from loraplex.worker.layers.embedding import Embedding
from loraplex.worker.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from loraplex.worker.layers.moe import MoEExperts, RouterLinear, SparseMoeBlock, route
from loraplex.worker.layers.norm import Gemma4RMSNorm
from loraplex.worker.layers.rotary import RotaryEmbedding
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.gemma2 import Gemma2ForCausalLM, GemmaMLP
from loraplex.worker.model.gemma4_vision import Gemma4VisionEmbedder, Gemma4VisionTower
from loraplex.worker.model.llama import layer_attention
from loraplex.worker.parallel import current_tp
from torch import nn


class Gemma4Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer_id: int):
        super().__init__()
        g4, hidden, eps = config.gemma4, config.hidden_size, config.rms_norm_eps
        self.head_dim = head_dim = g4.head_dims[layer_id]
        q_size, kv_size = config.num_heads * head_dim, g4.kv_heads[layer_id] * head_dim
        self.rotary = rotary
        self.layer = layer_attention(config, layer_id)
        self.cache_elements = g4.cache_elements(layer_id, current_tp().world_size)
        self.q_proj = ColumnParallelLinear(hidden, q_size, bias=config.qkv_bias)
        self.q_norm = Gemma4RMSNorm(head_dim, eps)
        self.is_kv_shared = g4.is_kv_shared(layer_id)
        if not self.is_kv_shared:
            self.k_proj = ColumnParallelLinear(hidden, kv_size, bias=config.qkv_bias)
            self.v_proj = None if g4.values_are_keys[layer_id] else \
                ColumnParallelLinear(hidden, kv_size, bias=config.qkv_bias)  # fmt: skip
            self.k_norm = Gemma4RMSNorm(head_dim, eps)
            self.v_norm = Gemma4RMSNorm(head_dim, eps, with_weight=False)
        self.o_proj = RowParallelLinear(q_size, hidden, bias=config.o_bias)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        attention: BatchAttention,
        image_blocks: list[ImageBlock] | None = None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q = self.q_norm(self.q_proj(hidden).view(num_tokens, -1, self.head_dim))  # (tokens, heads, head_dim)
        k_cache, v_cache = (self._layer_view(cache) for cache in kv)  # (slots, kv_heads, head_dim) each
        if self.is_kv_shared:
            # a throwaway key beside q: the rotary ops rotate a pair (in place on CUDA)
            q, _ = self.rotary(positions, q, q[:, :1].clone())
            out = attention.attend(q, k_cache, v_cache, self.layer)  # the source layer wrote these tokens' keys
        else:
            k = self.k_proj(hidden).view(num_tokens, -1, self.head_dim)  # (tokens, kv_heads, head_dim)
            v = k if self.v_proj is None else self.v_proj(hidden).view(num_tokens, -1, self.head_dim)
            v = self.v_norm(v)
            q, k = self.rotary(positions, q, self.k_norm(k))
            out = paged_attention(q, k, v, k_cache, v_cache, attention, self.layer)  # (tokens, heads, head_dim)
        window = self.layer.sliding_window
        if image_blocks and window is not None:  # the images' tokens see their runs whole
            out = attend_image_blocks(q, out, k_cache, v_cache, image_blocks, window, self.layer.scale)
        return self.o_proj(out.reshape(num_tokens, -1))  # (tokens, hidden)

    def _layer_view(self, cache: torch.Tensor) -> torch.Tensor:
        """(slots, heads, dim) of the widest layer -> (slots, kv_heads, head_dim) of this one: each slot's leading
        elements (a strided view where this layer is narrower)."""
        return cache.flatten(1)[:, : self.cache_elements].unflatten(1, (-1, self.head_dim))


class Gemma4Router(nn.Module):
    """Each token's top-k experts: softmax over proj(rmsnorm(x) * scale * hidden ** -0.5) in float32, the top-k
    renormalised, each weight times its expert's per_expert_scale."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.top_k, self.root_scale = top_k, hidden_size**-0.5
        self.norm = Gemma4RMSNorm(hidden_size, eps, with_weight=False)
        self.proj = RouterLinear(hidden_size, num_experts)
        self.scale = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.empty(num_experts), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.proj(self.norm(hidden) * self.scale * self.root_scale)  # (tokens, experts)
        weights, ids = route(logits, self.top_k, renormalize=True)  # (tokens, top_k) each
        return weights * self.per_expert_scale[ids].float(), ids


class Gemma4MoeBlock(SparseMoeBlock):
    """The experts (GeGLU) and their router (`gate`) beside the layer's dense MLP (`shared_experts`); the decoder
    layer feeds each its own input and norms (Gemma4DecoderLayer.feed_forward)."""

    def __init__(self, config: ModelConfig, dense_size: int):
        moe = config.moe
        experts = MoEExperts(moe.num_experts, config.hidden_size, moe.intermediate_size, act_fn=GeluTanhAndMul())
        super().__init__(config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size, renormalize=True,
                         experts=experts)  # fmt: skip
        self.gate = Gemma4Router(config.hidden_size, moe.num_experts, moe.top_k, config.rms_norm_eps)
        self.shared_experts = GemmaMLP(config, dense_size)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(hidden)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer_id: int):
        super().__init__()
        g4, hidden, eps = config.gemma4, config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.self_attn = Gemma4Attention(config, rotary, layer_id)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        mlp_size = g4.mlp_sizes[layer_id]
        self.mlp = GemmaMLP(config, mlp_size) if config.moe is None else Gemma4MoeBlock(config, mlp_size)
        if config.moe is not None:
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
        if g4.per_layer_input_size:
            self.per_layer_input_gate = ReplicatedLinear(hidden, g4.per_layer_input_size)
            self.per_layer_projection = ReplicatedLinear(g4.per_layer_input_size, hidden)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.empty(1), requires_grad=False)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        kv: tuple[torch.Tensor, torch.Tensor],
        attention: BatchAttention,
        image_blocks: list[ImageBlock] | None = None,
    ) -> torch.Tensor:
        """The stream after this layer (tokens, hidden); per_layer_input (tokens, per_layer_input_size) or None."""
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv, attention, image_blocks)
        hidden = hidden + self.post_attention_layernorm(attn)
        hidden = hidden + self.post_feedforward_layernorm(self.feed_forward(hidden))
        if per_layer_input is not None:
            gated = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh") * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dense = self.mlp if isinstance(self.mlp, GemmaMLP) else self.mlp.shared_experts
        out = dense(self.pre_feedforward_layernorm(hidden))  # (tokens, hidden)
        if dense is self.mlp:
            return out
        routed = self.mlp(self.pre_feedforward_layernorm_2(hidden), router_input=hidden)  # (tokens, hidden)
        return self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)


class Gemma4Model(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        g4, hidden = config.gemma4, config.hidden_size
        self.embed_tokens = Embedding(config.vocab_size, hidden)
        # In the activation dtype (the default dtype while the model is built), as HF rounds its scales.
        self.register_buffer("embed_scale", torch.tensor(hidden**0.5), persistent=False)
        rotaries: dict[tuple[bool, int], RotaryEmbedding] = {}  # (is sliding, head_dim) -> its rotary

        def rotary_of(layer_id: int) -> RotaryEmbedding:
            sliding, head_dim = config.layer_window(layer_id) is not None, g4.head_dims[layer_id]
            if (sliding, head_dim) not in rotaries:
                rope = config.local_rope if sliding and config.local_rope is not None else config.rope
                rotaries[(sliding, head_dim)] = RotaryEmbedding(head_dim, max_positions, rope)
            return rotaries[(sliding, head_dim)]

        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, rotary_of(i), i) for i in range(config.num_layers))
        self.norm = Gemma4RMSNorm(hidden, config.rms_norm_eps)
        # each layer's cache: its own, or a KV-shared layer's source's (the cache holds the others' alone)
        cache_index = {layer_id: i for i, layer_id in enumerate(config.attention_layer_ids)}
        self.cache_ids = [cache_index[source] for source in g4.kv_sources]
        self.num_layers, self.per_layer_size = config.num_layers, g4.per_layer_input_size
        if self.per_layer_size:
            size = config.num_layers * self.per_layer_size
            self.embed_tokens_per_layer = Embedding(g4.per_layer_vocab_size, size)
            self.register_buffer("per_layer_embed_scale", torch.tensor(self.per_layer_size**0.5), persistent=False)
            self.per_layer_model_projection = ReplicatedLinear(hidden, size)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        attention: BatchAttention,
        image_rows: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        pad_token_id: int = 0,
        image_blocks: list[ImageBlock] | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale  # (tokens, hidden)
        if image_rows is not None:  # the placeholder tokens' rows take their image's soft tokens
            hidden = hidden.index_copy(0, image_rows, image_embeds.to(hidden.dtype))
            input_ids = input_ids.index_fill(0, image_rows, pad_token_id)  # their per-layer inputs: the pad token's
        per_layer = self.per_layer_inputs(input_ids, hidden)
        for layer_id, layer in enumerate(self.layers):
            layer_input = None if per_layer is None else per_layer[:, layer_id]
            hidden = layer(positions, hidden, layer_input, kv_cache.layer(self.cache_ids[layer_id]), attention,
                           image_blocks)  # fmt: skip
        return self.norm(hidden)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor | None:
        """(tokens, layers, per_layer_input_size): (the token's own slice + the normed projection of its embedding)
        / sqrt(2); None without per-layer inputs."""
        if not self.per_layer_size:
            return None
        shape = (input_ids.shape[0], self.num_layers, self.per_layer_size)
        own = (self.embed_tokens_per_layer(input_ids) * self.per_layer_embed_scale).view(shape)
        projected = self.per_layer_model_projection(embeds) * embeds.shape[-1] ** -0.5
        return (self.per_layer_projection_norm(projected.view(shape)) + own) * 2.0**-0.5


class Gemma4ForCausalLM(Gemma2ForCausalLM):
    model_cls = Gemma4Model
    # (worker/loader.py) the multimodal checkpoint's language model, as Gemma4ForConditionalGeneration saves it;
    # None = not loaded
    checkpoint_prefixes = (
        ("model.language_model.", "model."),
        ("model.vision_tower.", None),
        ("model.audio_tower.", None),
        ("model.embed_vision.", None),
        ("model.embed_audio.", None),
    )

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__(config, max_positions)
        self.vision = config.vision  # a multimodal checkpoint's tower (None: text only, its tensors skipped)
        if config.vision is not None:
            self.vision_tower = Gemma4VisionTower(config.vision)
            self.embed_vision = Gemma4VisionEmbedder(config.vision)
            self.checkpoint_prefixes = (
                ("model.language_model.", "model."),
                ("model.vision_tower.", "vision_tower."),
                ("model.embed_vision.", "embed_vision."),
                ("model.audio_tower.", None),
                ("model.embed_audio.", None),
            )
        if config.moe is not None:  # the first that a name holds is replaced, once
            self.checkpoint_renames = (
                (".mlp.", ".mlp.shared_experts."),
                (".experts.", ".mlp.experts."),
                (".router.", ".mlp.gate."),
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        attention: BatchAttention,
        image_rows: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        image_blocks: list[ImageBlock] | None = None,
    ) -> torch.Tensor:
        pad = self.vision.pad_token_id if self.vision is not None else 0
        return self.model(input_ids, positions, kv_cache, attention, image_rows, image_embeds, pad,
                          image_blocks)  # (tokens, hidden)

    def encode_images(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        """(every image's soft tokens in order, hidden) from their patches (patches, patch dim) and (1, h, w) grids."""
        dtype = self.vision_tower.patch_embedder.position_embedding_table.dtype  # the activation dtype
        return self.embed_vision(self.vision_tower(pixels, grids), dtype)
