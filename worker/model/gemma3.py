"""Gemma 3 text decoder: Gemma 2's (gemma2.py) with per-head q/k RMSNorms before rotary, the local layers' own rope
base (ModelConfig.local_rope) and, in the published configs, no soft-capping (the config says).

A multimodal `gemma3` checkpoint (Gemma3ForConditionalGeneration) also runs its SigLIP vision tower and projector
(gemma3_vision.py): the pass hands the model its image rows already encoded (worker/images.py), `image_rows` (their
token rows in the batch) and `image_embeds`, which replace the placeholders' scaled embeddings. An image's
placeholders attend to each other both ways during prefill (SiglipVisionConfig.bidirectional_images: the pass's
attention holds the image_blocks)."""

from __future__ import annotations

import torch
from loraplex.worker.kv_cache import KVCache
from loraplex.worker.layers.attention import BatchAttention
from loraplex.worker.layers.norm import GemmaRMSNorm
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model
from loraplex.worker.model.gemma3_vision import MultiModalProjector, SiglipVisionModel
from loraplex.worker.model.image_rows import ImageRowsForward
from loraplex.worker.model.qwen3 import Qwen3Attention


class Gemma3Attention(Qwen3Attention):
    """Qwen3's per-head q and k norms, with Gemma's RMSNorm."""

    qk_norm_cls = GemmaRMSNorm


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3Model(Gemma2Model):
    layer_cls = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__(config, max_positions)
        self.vocab_size = config.vocab_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        attention: BatchAttention,
        image_rows: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if image_rows is None:
            return super().forward(input_ids, positions, kv_cache, attention)
        # the placeholder id may lie past the vocabulary (HF reads it as token 0): its rows are replaced anyway
        ids = input_ids.masked_fill(input_ids >= self.vocab_size, 0)
        hidden = self.embed_tokens(ids) * self.embed_scale  # (tokens, hidden)
        hidden = hidden.index_copy(0, image_rows, image_embeds.to(hidden.dtype))  # unscaled, as HF merges them
        residual = None
        for layer_id, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, kv_cache.layer(layer_id), attention)
        return self.norm(hidden, residual)[0]


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_cls = Gemma3Model
    # Checkpoint name prefixes -> ours (worker/loader.py): the multimodal checkpoints' language model, as
    # transformers 4 (language_model.model.*) and 5 (model.language_model.*) save it; None = not loaded.
    checkpoint_prefixes = (
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", None),
        ("model.vision_tower.", None),
        ("multi_modal_projector.", None),
        ("model.multi_modal_projector.", None),
    )


class Gemma3ForConditionalGeneration(ImageRowsForward, Gemma3ForCausalLM):
    """The multimodal checkpoint: the language model above, with the vision tower and projector when the config has
    them (ModelConfig.vision)."""

    checkpoint_prefixes = (
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        # the tower: transformers 4 (and the Hub) under vision_tower.vision_model.*, transformers 5 without it
        ("vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__(config, max_positions)
        self.vision_tower = SiglipVisionModel(config.vision)
        self.multi_modal_projector = MultiModalProjector(config.vision)

    def encode_images(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        """(every image's mm_tokens_per_image rows in order, text hidden) from pixels (images, channels, H, W)."""
        return self.multi_modal_projector(self.vision_tower(pixels))
