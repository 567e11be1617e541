"""Qwen3-VL: a Qwen3 decoder (q/k norms, no biases) with interleaved M-RoPE (worker/layers/rotary.py, rope params
`mrope_interleaved`) and the vision tower of qwen3_vl_vision.py, whose rows replace the image placeholder tokens'
embeddings; deepstack adds the tower's intermediate rows (its deepstack mergers') to the hidden states at the same
rows after each of the first decoder layers. Qwen3-VL-MoE (`qwen3_vl_moe`) is the same with Qwen3-MoE's layers.

As Qwen2.5-VL's (qwen2_5_vl.py), the pass hands the model its image rows already encoded (worker/images.py):
`image_rows` and `image_embeds` (image tokens, 1 + deepstack, hidden), the placeholder's row and its deepstack rows
carried together through chunked prefill and kept rows. Checkpoint names: `model.language_model.*`,
`model.visual.*` (as transformers 4.57+ and 5 save it) and the older `model.*`, `visual.*` both load."""

from __future__ import annotations

import torch
from loraplex.worker.kv_cache import KVCache
from loraplex.worker.layers.attention import BatchAttention
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.image_rows import ImageRowsForward
from loraplex.worker.model.qwen3 import Qwen3ForCausalLM, Qwen3Model
from loraplex.worker.model.qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeModel
from loraplex.worker.model.qwen3_vl_vision import Qwen3VLVisionTower


class Qwen3VLTextModel(Qwen3Model):
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
        deepstack = None
        if image_rows is not None:  # the placeholder tokens' rows take their image's embeddings
            image_embeds = image_embeds.to(hidden.dtype)  # (image tokens, 1 + deepstack, hidden)
            hidden = hidden.index_copy(0, image_rows, image_embeds[:, 0])
            deepstack = image_embeds[:, 1:]
        for layer_id, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, kv_cache.layer(layer_id), attention)
            if deepstack is not None and layer_id < deepstack.shape[1]:
                # the stream after this layer is hidden + residual: adding to either adds to it
                hidden = hidden.index_add(0, image_rows, deepstack[:, layer_id])
        return self.norm(hidden, residual)[0]


class Qwen3VLMoeTextModel(Qwen3VLTextModel, Qwen3MoeModel):
    """Qwen3-VL-MoE's decoder: Qwen3-MoE's layers (qwen3_moe.py builds them, dense ones where the config says) under
    Qwen3-VL's forward (image rows, deepstack)."""

    layer_cls = Qwen3MoeDecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__(config, max_positions)
        for layer in self.layers:
            experts = getattr(layer.mlp, "experts", None)
            for linear in (experts.gate_up_proj, experts.down_proj) if experts is not None else ():
                linear.either_layout = True  # published (experts, in, out); transformers 5 saves (experts, out, in)


class Qwen3VLForConditionalGeneration(ImageRowsForward, Qwen3ForCausalLM):
    model_cls = Qwen3VLTextModel
    checkpoint_prefixes = (
        ("model.language_model.", "model."),
        ("model.visual.", "visual."),
    )

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__(config, max_positions)
        self.visual = Qwen3VLVisionTower(config.vision)

    def encode_images(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        """(every image's placeholder rows in order, 1 + deepstack, hidden) from their patches and grids."""
        return self.visual(pixels, grids)


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    model_cls = Qwen3VLMoeTextModel
