"""SlotPlanner: which adapter (a lora_id) sits in which device slot.

Invariants:
- a held adapter (one that a running request uses) stays in its slot; each running request holds its adapter once;
- a pinned adapter, once resident, stays in its slot; at most num_slots - 1 adapters are pinned, so one slot
  always rotates and any adapter can get a slot once the running requests of some unpinned adapter finish;
- otherwise slots are reused least recently used first.
Base-model requests (lora_id None) use no slot and never reach this class.
"""

from __future__ import annotations

from collections.abc import Iterable


class SlotError(RuntimeError):
    """A slot operation that breaks the invariants above (a bug in the caller)."""


class SlotPlanner:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._slot_lora_ids: list[int | None] = [None] * num_slots
        self._slot_of: dict[int, int] = {}  # resident lora_id -> slot
        self._num_holds: dict[int, int] = {}  # lora_id -> running requests using it (absent = 0)
        self._last_used: dict[int, int] = {}  # resident lora_id -> tick of its last assign or release
        self._tick = 0
        self._pinned: set[int] = set()

    # ---- queries ---------------------------------------------------------------------------------

    @property
    def max_pinned(self) -> int:
        return self.num_slots - 1

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    def is_resident(self, lora_id: int) -> bool:
        return lora_id in self._slot_of

    def is_pinned(self, lora_id: int) -> bool:
        return lora_id in self._pinned

    def slot_table(self) -> list[int]:
        """lora_id per slot, -1 = empty."""
        return [-1 if lora_id is None else lora_id for lora_id in self._slot_lora_ids]

    def can_place(self, lora_ids: Iterable[int]) -> bool:
        """Could all of lora_ids be resident at once, next to every held adapter and every resident pinned one?"""
        needed = set(lora_ids) | self._num_holds.keys()
        pinned_elsewhere = {lora_id for lora_id in self._pinned if lora_id in self._slot_of and lora_id not in needed}
        return len(needed) + len(pinned_elsewhere) <= self.num_slots

    # ---- holds -------------------------------------------------------------------------------------

    def assign(self, lora_id: int) -> tuple[int, bool]:
        """Hold a slot for one running request of lora_id: (slot, is_new). is_new: the workers must load it there."""
        slot = self._slot_of.get(lora_id)
        is_new = slot is None
        if is_new:
            slot = self._take_slot(lora_id)
            self._slot_lora_ids[slot] = lora_id
            self._slot_of[lora_id] = slot
        self._num_holds[lora_id] = self._num_holds.get(lora_id, 0) + 1
        self._touch(lora_id)
        return slot, is_new

    def release(self, lora_id: int) -> None:
        holds = self._num_holds.get(lora_id, 0)
        if holds == 0:
            raise SlotError(f"adapter {lora_id} released without a hold")
        if holds == 1:
            del self._num_holds[lora_id]
        else:
            self._num_holds[lora_id] = holds - 1
        self._touch(lora_id)

    def _take_slot(self, lora_id: int) -> int:
        for slot, resident in enumerate(self._slot_lora_ids):
            if resident is None:
                return slot
        evictable = [i for i in self._slot_of if i not in self._num_holds and i not in self._pinned]
        if not evictable:
            raise SlotError(f"no slot for adapter {lora_id}: every slot is held or pinned")
        victim = min(evictable, key=self._last_used.__getitem__)
        return self._evict(victim)

    def _evict(self, lora_id: int) -> int:
        slot = self._slot_of.pop(lora_id)
        self._slot_lora_ids[slot] = None
        self._last_used.pop(lora_id, None)
        return slot

    def _touch(self, lora_id: int) -> None:
        self._tick += 1
        self._last_used[lora_id] = self._tick

    # ---- pins and unload -----------------------------------------------------------------------------

    def can_pin(self) -> bool:
        return self.num_pinned < self.max_pinned

    def pin(self, lora_id: int) -> None:
        """Pinned adapters take a slot on first use (like any other) and then never lose it."""
        if lora_id in self._pinned:
            return
        if not self.can_pin():
            raise SlotError(f"too many pinned adapters (at most {self.max_pinned} = max_loras_per_batch - 1)")
        self._pinned.add(lora_id)

    def unpin(self, lora_id: int) -> None:
        self._pinned.discard(lora_id)

    def drop(self, lora_id: int) -> int | None:
        """Forget an unloaded adapter: unpin it and free its slot. Returns the freed slot, if it had one."""
        if lora_id in self._num_holds:
            raise SlotError(f"adapter {lora_id} dropped while {self._num_holds[lora_id]} running requests use it")
        self._pinned.discard(lora_id)
        return self._evict(lora_id) if lora_id in self._slot_of else None
