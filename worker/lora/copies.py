"""Full module copies (PEFT's modules_to_save on embed_tokens / lm_head, or a pooling classifier's head) and
trainable tokens (a patch of embedding rows), selected per row by the row's LoRA slot.

ModuleCopies owns their device memory. A copy takes one of `--max-full-module-copies` places from the adapter's
install until its drop (a full copy is vocab × hidden, as large as the layer: the budget bounds them apart from the
LoRA pool); past the budget the load is refused. A classifier's head (labels × hidden, BERT's pooler hidden ×
hidden) is small and takes no place. The device copy is made when the adapter first fills a LoRA slot
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
from loraplex.protocol.adapters.adapter_config import HEAD_MODULES, AdapterLoadError
from loraplex.worker.loader import module_renamed, renamed
from loraplex.worker.lora.adapter import LoRAAdapter, copy_bias
from loraplex.worker.lora.vocab import EMBED, HEAD
from torch import nn

VOCAB_MODULES = (EMBED, HEAD)  # the copies that take a place: each as large as its layer


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
        if not any(m in VOCAB_MODULES for m in adapter.module_copies):  # a classifier's head is small: no place
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


class CopyHeadLinear(nn.Module):
    """A linear of a pooling classifier's head (a decoder's score, BERT's classifier or pooler.dense; hidden -> out),
    with each row of a slot holding a copy of it (`module`: the adapter's name for it) computed from the copy's
    weight and bias (the base's bias where the copy has none)."""

    def __init__(self, base: nn.Module, copies: ModuleCopies, batch, module: str):
        super().__init__()
        self.base, self.copies, self.batch, self.module = base, copies, batch, module

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def out_features(self) -> int:
        return self.base.weight.shape[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        y = self.base(hidden)  # (rows, out)
        row_slots = self.batch.row_slots  # (rows,), -1 for base rows
        for slot in self.batch.used_slots:
            weight = self.copies.slot_copies[slot].get(self.module)
            if weight is not None:
                bias = self.copies.slot_copies[slot].get(copy_bias(self.module), getattr(self.base, "bias", None))
                mine = F.linear(hidden, weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype))
                y = torch.where((row_slots == slot)[:, None], mine, y)
        return y


def wrap_head_linears(model: nn.Module, copies: ModuleCopies, batch) -> dict[str, nn.Module]:
    """Wrap each linear of a pooling classifier's head that an adapter may copy (HEAD_MODULES, PEFT's names: the
    checkpoint's, which the model maps to its own as it loads) in a CopyHeadLinear. Returns {name: the base linear}
    of those the model has (none: no classifier)."""
    prefixes = getattr(model, "checkpoint_prefixes", ())
    renames = getattr(model, "checkpoint_renames", ())
    params = dict(model.named_parameters())
    found = {}
    for module in HEAD_MODULES:
        ours = renamed(f"{module}.weight", prefixes)
        ours = None if ours is None else module_renamed(ours, renames).removesuffix(".weight")
        if ours is None or f"{ours}.weight" not in params:
            continue
        parent_name, _, attr = ours.rpartition(".")
        parent = model.get_submodule(parent_name)
        found[module] = getattr(parent, attr)
        setattr(parent, attr, CopyHeadLinear(found[module], copies, batch, module))
    return found


def check_head_copies(adapter: LoRAAdapter, head_linears: dict[str, nn.Module]) -> None:
    """An adapter's copies of a classifier's head fit only the served classifier's (its labels); AdapterLoadError
    otherwise."""
    heads = [m for m in adapter.module_copies if m in HEAD_MODULES]
    if not heads:
        return
    if not head_linears:
        raise AdapterLoadError(f"the adapter carries a classifier's head ({', '.join(heads)}: modules_to_save), but "
                               "this server runs no classifier with one (--runner pooling on a "
                               "*ForSequenceClassification checkpoint)")  # fmt: skip
    other = [m for m in heads if m not in head_linears]
    if other:
        raise AdapterLoadError(f"the adapter carries a copy of {', '.join(other)} (modules_to_save), which the served "
                               f"classifier does not have (its head: {', '.join(head_linears)})")  # fmt: skip
    for module in heads:
        copy, base = adapter.module_copies[module], head_linears[module].weight
        if copy.shape[0] != base.shape[0]:
            what = "outputs" if module == "pooler.dense" else "labels"
            raise AdapterLoadError(f"the adapter's {module} has {copy.shape[0]} {what}, the served model's "
                                   f"{base.shape[0]}")  # fmt: skip
