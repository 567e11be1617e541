"""Qwen2.5-VL: a Qwen2 decoder (q/k/v biases) with M-RoPE (worker/layers/rotary.py: the rotary frequencies split by
mrope_section over three position rows) and the vision tower of qwen2_5_vl_vision.py, whose rows replace the image
placeholder tokens' embeddings.

The pass hands the model its image rows already encoded (worker/images.py): `image_rows` (their token rows in the
batch) and `image_embeds` (their embeddings), so a text-only pass is the plain decoder. Checkpoint names: the
transformers 4 layout (`model.*`, `visual.*`, `lm_head.*`, as transformers 5 also saves it) loads as is; the
transformers 5 in-memory layout (`model.language_model.*`, `model.visual.*`) is renamed."""

from __future__ import annotations

import torch
from loraplex.worker.kv_cache import KVCache
from loraplex.worker.layers.attention import BatchAttention
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.image_rows import ImageRowsForward
from loraplex.worker.model.llama import LlamaForCausalLM, LlamaModel
from loraplex.worker.model.qwen2_5_vl_vision import VisionTower


class Qwen2_5_VLTextModel(LlamaModel):
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        attention: BatchAttention,
        image_rows: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # (tokens, hidden)
        if image_rows is not None:  # the placeholder tokens' rows take their image's embeddings
            hidden = hidden.index_copy(0, image_rows, image_embeds.to(hidden.dtype))
        for layer_id, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, kv_cache.layer(layer_id), attention)
        return self.norm(hidden, residual)[0]


class Qwen2_5_VLForConditionalGeneration(ImageRowsForward, LlamaForCausalLM):
    model_cls = Qwen2_5_VLTextModel
    checkpoint_prefixes = (
        ("model.language_model.", "model."),
        ("model.visual.", "visual."),
    )

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__(config, max_positions)
        self.visual = VisionTower(config.vision)

    def encode_images(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        """(every image's placeholder rows in order, hidden) from their patches (patches, patch dim) and grids."""
        return self.visual(pixels, grids)
