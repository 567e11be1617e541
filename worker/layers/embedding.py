"""Token embedding and LM head, replicated on every rank (their cost is small next to the decoder layers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loraplex.kernels import cpu_gemv
from loraplex.worker.layers import packed
from torch import nn


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # (tokens, hidden)


class LMHead(nn.Module):
    """hidden -> logits. With tied embeddings it shares the embedding's weight tensor."""

    packed_weight: torch.Tensor | None = None  # set by packed.pack_linears (the CPU bfloat16 path), if not tied
    gemv: cpu_gemv.PackedWeight | None = None  # set by packed.use_gemv (the CPU bfloat16 decode kernel)

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: Embedding | None = None):
        super().__init__()
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return packed.linear(hidden, self.weight, self.packed_weight, gemv=self.gemv)  # (rows, vocab)
