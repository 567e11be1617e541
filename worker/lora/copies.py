"""Full module copies (PEFT's modules_to_save on embed_tokens / lm_head) and trainable tokens (a patch of embedding
rows), selected per row by the row's LoRA slot.

ModuleCopies owns their device memory. A copy takes one of `--max-full-module-copies` places from the adapter's
install until its drop (a full copy is vocab × hidden, as large as the layer: the budget bounds them apart from the
LoRA pool); past the budget the load is refused. The device copy is made when the adapter first fills a LoRA slot
(the forward's thread, through the uploader), and kept until the adapter is dropped. Trainable tokens are small and
take no place. Both layers are replicated on every rank, so each rank holds whole copies.

The wrappers replace the rows of the slots that hold a copy (embedding lookup or head matmul from the copy) and the
patched tokens' rows; with tied embeddings a trainable tokens patch is also the head's (PEFT ties them). Decode CUDA
graphs do not run these terms: a batch whose slots hold any runs eagerly (model_runner)."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from loraplex.protocol.adapters.adapter_config import AdapterLoadError
from loraplex.worker.lora.adapter import LoRAAdapter
from loraplex.worker.lora.vocab import EMBED, HEAD
from torch import nn

SCORE = "score"  # a pooling model's classification head (worker/pooling.py)


class ModuleCopies:
    def __init__(self, max_copies: int, num_slots: int, device: torch.device, tied: bool):
        self.max_copies, self.device, self.tied = max_copies, device, tied
        self.holders: set[int] = set()  # lora_ids holding a place
        self._lock = threading.Lock()  # reserve runs on the loader's thread, release on the forward's
        self.device_copies: dict[int, dict[str, torch.Tensor]] = {}  # lora_id -> module -> (vocab, hidden)
        self.device_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # lora_id -> (ids (k,), rows (k, hidden))
        self.slot_copies: list[dict[str, torch.Tensor]] = [{} for _ in range(num_slots)]
        self.slot_rows: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_slots

    def reserve(self, adapter: LoRAAdapter) -> None:
        """Take a place for the adapter's copies, if it has any; AdapterLoadError when none is free."""
        if not adapter.module_copies:
            return
        with self._lock:
            if len(self.holders) >= self.max_copies:
                raise AdapterLoadError(
                    f"the adapter carries full copies of {', '.join(adapter.module_copies)} (modules_to_save), and "
                    f"all {self.max_copies} places for them are taken (--max-full-module-copies {self.max_copies})"
                )
            self.holders.add(adapter.lora_id)

    def release(self, lora_id: int) -> None:
        with self._lock:
            self.holders.discard(lora_id)
        self.device_copies.pop(lora_id, None)
        self.device_rows.pop(lora_id, None)

    @torch.no_grad()
    def load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Point the slot at the adapter's device copies and rows, made on first use (inside the uploader)."""
        if adapter.module_copies and adapter.lora_id not in self.device_copies:
            self.device_copies[adapter.lora_id] = {m: t.to(self.device, non_blocking=True)
                                                   for m, t in adapter.module_copies.items()}  # fmt: skip
        if adapter.token_rows is not None and adapter.lora_id not in self.device_rows:
            self.device_rows[adapter.lora_id] = tuple(t.to(self.device, non_blocking=True) for t in adapter.token_rows)
        self.slot_copies[slot] = self.device_copies.get(adapter.lora_id, {})
        self.slot_rows[slot] = self.device_rows.get(adapter.lora_id)

    def clear_slot(self, slot: int) -> None:
        self.slot_copies[slot], self.slot_rows[slot] = {}, None

    def holds_any(self, slots: Iterable[int]) -> bool:
        return any(self.slot_copies[s] or self.slot_rows[s] is not None for s in slots if s >= 0)


class CopyEmbedding(nn.Module):
    """The embedding, with each row of a slot holding a copy looked up in it and each patched token's row replaced."""

    def __init__(self, base: nn.Module, copies: ModuleCopies, batch):
        super().__init__()
        self.base, self.copies, self.batch = base, copies, batch

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        y = self.base(input_ids)  # (tokens, hidden)
        token_slots = self.batch.token_slots  # (tokens,), -1 for base rows
        for slot in self.batch.used_slots:
            copy = self.copies.slot_copies[slot].get(EMBED)
            if copy is not None:
                y = torch.where((token_slots == slot)[:, None], F.embedding(input_ids, copy), y)
            patch = self.copies.slot_rows[slot]
            if patch is not None:
                ids, rows = patch  # (k,), (k, hidden)
                hits = input_ids[:, None] == ids[None, :]  # (tokens, k)
                patched = rows[hits.int().argmax(dim=1)]  # (tokens, hidden)
                y = torch.where(((token_slots == slot) & hits.any(dim=1))[:, None], patched.to(y.dtype), y)
        return y


class CopyLMHead(nn.Module):
    """The LM head, with each row of a slot holding a copy computed from it; with tied embeddings, the patched
    tokens' logits from their rows."""

    def __init__(self, base: nn.Module, copies: ModuleCopies, batch):
        super().__init__()
        self.base, self.copies, self.batch = base, copies, batch

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        y = self.base(hidden)  # (rows, vocab)
        row_slots = self.batch.row_slots  # (rows,), -1 for base rows
        for slot in self.batch.used_slots:
            copy = self.copies.slot_copies[slot].get(HEAD)
            if copy is not None:
                y = torch.where((row_slots == slot)[:, None], hidden @ copy.T, y)
            patch = self.copies.slot_rows[slot]
            if patch is not None and self.copies.tied:
                ids, rows = patch
                logits = hidden @ rows.T.to(hidden.dtype)  # (rows, k)
                mine = (row_slots == slot)[:, None]
                y = y.index_copy(1, ids, torch.where(mine, logits, y[:, ids]))
        return y


class CopyScoreHead(nn.Module):
    """A pooling model's score head (hidden -> labels), with each row of a slot holding a copy computed from it."""

    def __init__(self, base: nn.Module, copies: ModuleCopies, batch):
        super().__init__()
        self.base, self.copies, self.batch = base, copies, batch

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        y = self.base(hidden)  # (rows, labels)
        row_slots = self.batch.row_slots  # (rows,), -1 for base rows
        for slot in self.batch.used_slots:
            copy = self.copies.slot_copies[slot].get(SCORE)
            if copy is not None:
                y = torch.where((row_slots == slot)[:, None], hidden @ copy.T.to(hidden.dtype), y)
        return y
