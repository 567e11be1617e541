"""Read-outs of scheduler state that only tests ask for (no tests here)."""

from __future__ import annotations

from loraplex.scheduler.adapter_table import AdapterTable
from loraplex.scheduler.request import Request
from loraplex.scheduler.scheduler import Scheduler
from loraplex.scheduler.slot_planner import SlotPlanner


def in_flight_requests(scheduler: Scheduler) -> list[Request]:
    """The requests of the newest batch in flight, in the batch's order (empty when none is)."""
    return list(scheduler._in_flight[-1].reqs) if scheduler._in_flight else []


def slot_of(slots: SlotPlanner, lora_id: int) -> int | None:
    return slots._slot_of.get(lora_id)


def num_holds(slots: SlotPlanner, lora_id: int) -> int:
    return slots._num_holds.get(lora_id, 0)


def held_lora_ids(slots: SlotPlanner) -> set[int]:
    return set(slots._num_holds)


def num_pending_loads(adapters: AdapterTable) -> int:
    return len(adapters._pending)
