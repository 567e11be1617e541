"""The forward of a vision-language model whose decoder takes the pass's image rows (worker/images.py encoded them):
`image_rows` (the placeholders' token rows in the batch) and `image_embeds` (their embeddings) go to the decoder,
which puts them in place of the placeholders' embeddings; a text-only pass gives neither."""

from __future__ import annotations

import torch
from loraplex.worker.kv_cache import KVCache
from loraplex.worker.layers.attention import BatchAttention


class ImageRowsForward:
    """Mixed in before the causal-LM class: forward hands the image rows to `self.model`."""

    model: torch.nn.Module

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        attention: BatchAttention,
        image_rows: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_cache, attention, image_rows, image_embeds)  # (tokens, hidden)
