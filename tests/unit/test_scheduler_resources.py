"""PageAllocator and SlotPlanner on plain ints."""

from __future__ import annotations

import pytest
from loraplex.scheduler.page_allocator import PageAllocator, PageError
from loraplex.scheduler.slot_planner import SlotError, SlotPlanner

from tests.scheduler_helpers import num_holds, slot_of

# ---- PageAllocator -------------------------------------------------------------------------------------


def test_allocate_and_free_round_trip():
    pages = PageAllocator(8)
    first = pages.allocate(3)
    second = pages.allocate(5)
    assert len(set(first + second)) == 8 and set(first + second) == set(range(8))
    assert pages.num_free == 0 and pages.usage == 1.0
    assert not pages.can_allocate(1) and pages.can_allocate(0)
    pages.free(first)
    assert pages.num_free == 3 and pages.usage == pytest.approx(5 / 8)
    assert sorted(pages.allocate(3)) == sorted(first)


def test_allocate_more_than_free_raises():
    pages = PageAllocator(4)
    pages.allocate(3)
    with pytest.raises(PageError):
        pages.allocate(2)
    assert pages.num_free == 1


def test_double_free_raises():
    pages = PageAllocator(4)
    page_ids = pages.allocate(2)
    pages.free(page_ids)
    with pytest.raises(PageError, match="twice"):
        pages.free(page_ids[:1])
    assert pages.num_free == 4


def test_free_of_unknown_or_repeated_page_raises_and_changes_nothing():
    pages = PageAllocator(4)
    page_ids = pages.allocate(2)
    with pytest.raises(PageError):
        pages.free([page_ids[0], 99])
    with pytest.raises(PageError, match="repeated"):
        pages.free([page_ids[0], page_ids[0]])
    with pytest.raises(PageError):
        pages.free([-1])
    assert pages.num_free == 2  # the bad calls freed nothing, not even the valid page
    pages.free(page_ids)
    assert pages.num_free == 4


def test_page_allocator_needs_a_page():
    with pytest.raises(ValueError):
        PageAllocator(0)


# ---- SlotPlanner ----------------------------------------------------------------------------------------


def test_assign_reuses_a_resident_slot_and_fills_free_slots():
    slots = SlotPlanner(2)
    assert slots.assign(10) == (0, True)
    assert slots.assign(10) == (0, False)  # a second request of the same adapter
    assert slots.assign(11) == (1, True)
    assert slots.slot_table() == [10, 11]
    assert num_holds(slots, 10) == 2


def test_lru_eviction_picks_the_least_recently_used_unheld_adapter():
    slots = SlotPlanner(2)
    slots.assign(1)
    slots.assign(2)
    slots.release(2)
    slots.release(1)  # 1 was used more recently than 2
    assert slots.assign(3) == (1, True)  # evicts 2, in slot 1
    assert slots.slot_table() == [1, 3]
    assert not slots.is_resident(2)
    slots.release(3)
    slots.assign(1)  # touch 1
    slots.release(1)
    assert slots.assign(4) == (1, True)  # 3 is now the least recently used


def test_never_evicts_an_adapter_a_running_request_needs():
    slots = SlotPlanner(2)
    slots.assign(1)
    slots.assign(2)
    assert not slots.can_place([3])
    with pytest.raises(SlotError):
        slots.assign(3)
    slots.release(2)
    assert slots.can_place([1, 3])
    assert not slots.can_place([2, 3])  # 1 is held, so 2 and 3 would need three slots
    assert slots.assign(3) == (1, True)
    assert slot_of(slots, 1) == 0
    with pytest.raises(SlotError, match="without a hold"):
        slots.release(2)


def test_pinned_adapters_keep_their_slots():
    slots = SlotPlanner(3)
    slots.pin(7)
    pinned_slot, _ = slots.assign(7)
    slots.release(7)
    for lora_id in range(20):  # many other adapters rotate through the other slots
        slot, _ = slots.assign(lora_id + 100)
        assert slot != pinned_slot
        slots.release(lora_id + 100)
    assert slot_of(slots, 7) == pinned_slot
    # The pinned adapter takes a slot in can_place even when the batch does not need it.
    slots.assign(200)
    assert slots.can_place([201]) and not slots.can_place([201, 202])
    slots.release(200)
    slots.unpin(7)
    assert slots.can_place([201, 202, 203])


def test_pin_limit_leaves_one_slot_rotating():
    slots = SlotPlanner(3)
    assert slots.max_pinned == 2
    slots.pin(1)
    slots.pin(2)
    slots.pin(2)  # pinning twice is harmless
    assert slots.num_pinned == 2 and not slots.can_pin()
    with pytest.raises(SlotError, match=r"too many pinned adapters \(at most 2 = max_loras_per_batch - 1\)"):
        slots.pin(3)
    slots.assign(1)
    slots.assign(2)
    slots.release(1)
    slots.release(2)
    for lora_id in (3, 4, 5):  # every unpinned adapter still gets the remaining slot
        assert slots.assign(lora_id) == (2, True)
        slots.release(lora_id)
    assert SlotPlanner(1).max_pinned == 0


def test_drop_frees_the_slot_and_the_pin():
    slots = SlotPlanner(2)
    slots.pin(1)
    slots.assign(1)
    with pytest.raises(SlotError, match="running requests use it"):
        slots.drop(1)
    slots.release(1)
    assert slots.drop(1) == 0
    assert slots.slot_table() == [-1, -1] and not slots.is_pinned(1)
    assert slots.drop(1) is None  # not resident any more
    assert slots.assign(2) == (0, True)
