"""Read-outs of scheduler state that only tests ask for (no tests here)."""

from __future__ import annotations

from loraplex.scheduler.adapter_table import AdapterTable
from loraplex.scheduler.prefix_cache import PrefixCache
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


def kept_snapshots(cache: PrefixCache) -> dict[int, int]:
    """Cached page -> the state snapshot saved at its end (hybrid models)."""
    return dict(cache._snapshot_of_page)


def saving_snapshots(scheduler: Scheduler) -> list[int]:
    """The state snapshots that passes in flight save into."""
    return [snapshot for batch in scheduler._in_flight for saves in batch.saves for _, snapshot in saves]


def cached_namespaces(cache: PrefixCache) -> set[int]:
    return set(cache._namespace_of_page.values())
