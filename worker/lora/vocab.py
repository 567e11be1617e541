"""LoRA on the embedding and the LM head (protocol/adapters/lora_targets.MODEL_TARGETS), the layers whose size is the
vocabulary.

PEFT's LoRA on the embedding adds scale · A[:, token]ᵀ·Bᵀ to each token's row (lora_embedding_A (r, vocab),
lora_embedding_B (hidden, r)); on the LM head, as on any linear, scale · (h·Aᵀ)·Bᵀ to each logits row. Both layers are
replicated on every rank, so each rank computes the whole term. Computed with torch ops whatever the LoRA backend
(the segmented kernels are for the decoder's linears): per adapter in the batch, one product over the rows, kept
where the row's slot is that adapter's, so a batch costs (its adapters on these layers) × (rows × r × out) more; no
host sync, no data-dependent shape. Decode CUDA graphs are refused with these targets (model_runner)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

EMBED, HEAD = "embed_tokens", "lm_head"


@dataclass(frozen=True)
class VocabLoRABuffers:
    """One layer's slots; zero past an adapter's rank and for a slot whose adapter does not target the layer."""

    module: str  # EMBED or HEAD
    # EMBED: (slots, vocab, max_rank) = Aᵀ, rows gathered by token id; HEAD: (slots, max_rank, hidden) = A
    lora_a: torch.Tensor
    lora_b: torch.Tensor  # (slots, max_rank, out) = Bᵀ
    host_ranks: list[int]  # per slot: the adapter's r where it targets this layer, else 0
    host_scales: list[float]  # the pool's, shared by every layer

    @classmethod
    def empty(cls, module: str, in_features: int, out_features: int, num_slots: int, max_rank: int,
              host_scales: list[float], dtype: torch.dtype, device: torch.device) -> VocabLoRABuffers:  # fmt: skip
        shape_a = (num_slots, in_features, max_rank) if module == EMBED else (num_slots, max_rank, in_features)
        return cls(
            module=module,
            lora_a=torch.zeros(shape_a, dtype=dtype, device=device),
            lora_b=torch.zeros(num_slots, max_rank, out_features, dtype=dtype, device=device),
            host_ranks=[0] * num_slots,
            host_scales=host_scales,
        )

    @torch.no_grad()
    def load(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """lora_a (r, in), lora_b (out, r): an adapter's pair for this layer, as PEFT stores it."""
        r = lora_a.shape[0]
        if self.module == EMBED:
            self.lora_a[slot, :, :r].copy_(lora_a.T, non_blocking=True)  # (vocab, r)
        else:
            self.lora_a[slot, :r].copy_(lora_a, non_blocking=True)  # (r, hidden)
        self.lora_b[slot, :r].copy_(lora_b.T, non_blocking=True)  # (r, out)
        self.host_ranks[slot] = r

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.host_ranks[slot] = 0

    @property
    def num_bytes(self) -> int:
        return self.lora_a.nbytes + self.lora_b.nbytes


def add_per_slot(y: torch.Tensor, shrunk: dict[int, torch.Tensor], row_slots: torch.Tensor,
                 buffers: VocabLoRABuffers, row_scales: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """y (rows, out) + scale · shrunk[slot] · Bᵀ[slot] on the rows of each slot; shrunk[slot] (rows, max_rank);
    row_scales (rows,): each row's request strength (None: all 1)."""
    for slot, rows_r in shrunk.items():
        delta = (rows_r @ buffers.lora_b[slot]) * buffers.host_scales[slot]  # (rows, out)
        if row_scales is not None:
            delta = delta * row_scales.to(delta.dtype)[:, None]
        y = y + torch.where((row_slots == slot)[:, None], delta, 0)
    return y


class LoRAEmbedding(nn.Module):
    def __init__(self, base: nn.Module, buffers: VocabLoRABuffers, batch):
        super().__init__()
        self.base, self.buffers, self.batch = base, buffers, batch

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        y = self.base(input_ids)  # (tokens, hidden)
        slots = self.batch.vocab_slots(EMBED, self.buffers)
        if not slots:
            return y
        token_slots = self.batch.token_slots  # (tokens,), -1 for base rows
        rows_r = self.buffers.lora_a[token_slots.clamp(min=0), input_ids]  # (tokens, max_rank): A[:, token]ᵀ
        return add_per_slot(y, dict.fromkeys(slots, rows_r), token_slots, self.buffers, self.batch.token_scales)


class LoRALMHead(nn.Module):
    def __init__(self, base: nn.Module, buffers: VocabLoRABuffers, batch):
        super().__init__()
        self.base, self.buffers, self.batch = base, buffers, batch

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        y = self.base(hidden)  # (rows, vocab)
        slots = self.batch.vocab_slots(HEAD, self.buffers)
        if not slots:
            return y
        shrunk = {slot: hidden @ self.buffers.lora_a[slot].T for slot in slots}  # (rows, max_rank) each
        return add_per_slot(y, shrunk, self.batch.row_slots, self.buffers, self.batch.row_scales)
