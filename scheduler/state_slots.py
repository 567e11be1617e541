"""StateSlotAllocator: the free list of a hybrid model's state slots (one per running request; each holds the
request's linear-attention recurrent and conv states on every rank), and of its state snapshots (the same states
kept at a cached page boundary for the prefix cache). Both are plain ints; the workers own the tensors behind them."""

from __future__ import annotations


class StateSlotError(RuntimeError):
    """A slot freed twice, or one this allocator never handed out."""


class StateSlotAllocator:
    def __init__(self, num_slots: int, kind: str = "state slot"):
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self.kind = kind  # what its errors call a slot
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: low ids first
        self._is_allocated = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free_slots)

    def can_allocate(self) -> bool:
        return bool(self._free_slots)

    def allocate(self) -> int:
        if not self._free_slots:
            raise StateSlotError(f"no {self.kind} free of {self.num_slots}")
        slot = self._free_slots.pop()
        self._is_allocated[slot] = True
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise StateSlotError(f"{self.kind} {slot} is not one of this allocator's {self.num_slots}")
        if not self._is_allocated[slot]:
            raise StateSlotError(f"{self.kind} {slot} freed twice")
        self._is_allocated[slot] = False
        self._free_slots.append(slot)
