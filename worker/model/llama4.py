"""Llama 4's language model (`llama4_text`, and the multimodal `llama4` checkpoint's): the Llama decoder with

- attention: RoPE layers attend within chunks of `attention_chunk_size` (chunked local attention: a query at p sees
  the keys of its own chunk up to p; worker/layers/attention.py masks it) and L2-norm q and k per head after rotary
  (`use_qk_norm`: RMS without a weight); every `no_rope_layer_interval`-th layer is a NoPE layer, global, without
  rotary, whose queries are scaled by 1 + attn_scale * log1p(floor((p + 1) / floor_scale)) (attention-temperature
  tuning). Rotary rotates (even, odd) pairs of each head, as complex numbers (the reference's apply_rotary_emb): q
  and k are de-interleaved first, the same permutation for both, which leaves q·k and the per-head norm unchanged,
  and then rotate as rotate-half does.
- MoE layers (`moe_layers`, from `interleave_moe_layer_step`): a sigmoid top-k router whose weight scales each chosen
  expert's input, and a shared expert (worker/layers/moe.py InputScaledMoeBlock); the other layers are dense MLPs of
  `intermediate_size_mlp`. Checkpoints store the experts stacked (experts, in, out) (`feed_forward.experts.gate_up_proj`
  with gate | up, `feed_forward.experts.down_proj`), loaded transposed.

Checkpoint names (`feed_forward.*`, `feed_forward.shared_expert.*`, `feed_forward.router`) are read as ours
(`mlp.*`, `mlp.shared_experts.*`, `mlp.gate`), where LoRA finds the MLPs of every family; the multimodal
checkpoint's language model is read under `language_model.`; Llama4ForConditionalGeneration adds its vision model and
projector (llama4_vision.py), whose rows replace the `<|patch|>` placeholders' embeddings (a `llama4` config without a
vision_config serves the language model alone)."""

from __future__ import annotations

import torch
from loraplex.worker.kv_cache import KVLayer
from loraplex.worker.layers.attention import BatchAttention, paged_attention
from loraplex.worker.layers.attention_spec import LayerAttention
from loraplex.worker.layers.moe import InputScaledMoeBlock
from loraplex.worker.layers.norm import RMSNorm
from loraplex.worker.layers.rotary import RotaryEmbedding
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.image_rows import ImageRowsForward
from loraplex.worker.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    layer_attention,
)
from loraplex.worker.model.llama4_vision import Llama4Projector, Llama4VisionModel
from loraplex.worker.model.qwen2_5_vl import Qwen2_5_VLTextModel
from torch import nn


class Llama4Attention(LlamaAttention):
    """`rotary` None: a NoPE layer."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding | None, layer: LayerAttention):
        super().__init__(config, rotary, layer)
        self.eps = config.rms_norm_eps
        self.qk_l2_norm = config.qk_l2_norm and rotary is not None
        self.temperature = config.attn_temperature if rotary is None else None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv: KVLayer,
        attention: BatchAttention,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes_per_rank, dim=-1)
        q = q.view(num_tokens, -1, self.head_dim)  # (tokens, heads, head_dim)
        k = k.view(num_tokens, -1, self.head_dim)  # (tokens, kv_heads, head_dim)
        v = v.view(num_tokens, -1, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, _deinterleave(q), _deinterleave(k))
        if self.qk_l2_norm:
            q, k = _l2_norm(q, self.eps), _l2_norm(k, self.eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0  # (tokens,)
            q = (q * scales[:, None, None]).to(q.dtype)
        out = paged_attention(q, k, v, kv[0], kv[1], attention, self.layer, kv.scales)  # (tokens, heads, head_dim)
        return self.o_proj(out.reshape(num_tokens, -1))  # (tokens, hidden)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., head_dim) pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...): the rotate-half layout."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head's x / rms(x), in float32 as the reference's Llama4TextL2Norm (no weight)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4DecoderLayer(LlamaDecoderLayer):
    """A NoPE layer's attention gets no rotary; an MoE layer's MLP is the experts and shared expert, a dense one's a
    SiLU-gated MLP of intermediate_size_mlp (ModelConfig.intermediate_size)."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer_id: int):
        nn.Module.__init__(self)  # LlamaDecoderLayer's parts, each chosen for this layer
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        layer_rotary = None if layer_id in config.nope_layers else rotary
        self.self_attn = Llama4Attention(config, layer_rotary, layer_attention(config, layer_id))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config) if layer_id in config.moe.dense_layers else _moe_block(config)


def _moe_block(config: ModelConfig) -> InputScaledMoeBlock:
    moe = config.moe
    shared = LlamaMLP(config, intermediate_size=moe.shared_intermediate_size)
    block = InputScaledMoeBlock(config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size, shared)
    for linear in (block.experts.gate_up_proj, block.experts.down_proj):
        linear.stacked_in_out = moe.stacked_in_out
    return block


class Llama4Model(LlamaModel):
    layer_cls = Llama4DecoderLayer


class Llama4ForCausalLM(LlamaForCausalLM):
    model_cls = Llama4Model
    # (worker/loader.py) the multimodal checkpoint's language model, as Llama4ForConditionalGeneration saves it;
    # None = not loaded
    checkpoint_prefixes = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_model.", None),
        ("multi_modal_projector.", None),
    )
    # the first that a name holds is replaced, once
    checkpoint_renames = (
        (".feed_forward.shared_expert.", ".mlp.shared_experts."),
        (".feed_forward.router.", ".mlp.gate."),
        (".feed_forward.", ".mlp."),
    )


class Llama4ImageModel(Qwen2_5_VLTextModel):
    """Llama 4's decoder whose forward takes image rows (Qwen2.5-VL's: the placeholders' embeddings replaced)."""

    layer_cls = Llama4DecoderLayer


class Llama4ForConditionalGeneration(ImageRowsForward, Llama4ForCausalLM):
    model_cls = Llama4ImageModel
    checkpoint_prefixes = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    )

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__(config, max_positions)
        self.vision_model = Llama4VisionModel(config.vision)
        self.multi_modal_projector = Llama4Projector(config.vision)

    def encode_images(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        """(every tile's placeholder rows in order, hidden) from the tiles (tiles, channels, size, size); each
        tile is one image of worker/images.py (its grid unused)."""
        rows = self.multi_modal_projector(self.vision_model(pixels))  # (tiles, tokens_per_tile, hidden)
        return rows.flatten(0, 1)
