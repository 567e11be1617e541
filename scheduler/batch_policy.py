"""BatchPolicy: which waiting requests join the next forward pass (every running request decodes anyway).

Waiting requests are admitted first come, first served, while
- the running requests stay within max_running_requests,
- the prompts admitted this step stay within max_prefill_tokens (one request is always allowed, however long),
- the pages for the whole request (prompt + max_new_tokens) can be reserved, so no request is ever preempted,
- the batch's distinct adapters fit the slots (SlotPlanner.can_place).
A request that fails one of the first three stops admission for this step: nobody overtakes it, and since the
running requests only drain, it gets in once enough of them finish.

No starvation on slots. The first request that fits everything but the slots is the *blocked head*. Requests behind
it may still go ahead when they need no new slot (base model, or an adapter already in the batch), with two limits:
- they leave one running place and the blocked head's pages free, so the head needs only a slot;
- none may use the *draining* adapter: of the unpinned adapters in the batch, the one whose requests finish soonest
  (fewest remaining tokens, worst case). Its hold only shrinks, so its slot frees up for the blocked head.
Bound: each step the draining adapter's worst-case remaining tokens drop by one (it is re-chosen as the minimum every
step, which can only be lower), so a request that is the blocked head at step t is admitted by step t + D + 1, where
D = the draining adapter's remaining tokens at step t <= the largest max_new_tokens among running requests.
An unpinned adapter in the batch always exists when the head is blocked: at most num_slots - 1 adapters are pinned.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from scheduler.page_allocator import PageAllocator
from scheduler.request import Request
from scheduler.slot_planner import SlotPlanner


class BatchPolicy:
    def __init__(self, *, max_running_requests: int, max_prefill_tokens: int, page_size: int):
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.page_size = page_size

    def pick_prefills(
        self, waiting: Iterable[Request], running: Sequence[Request], pages: PageAllocator, slots: SlotPlanner
    ) -> list[Request]:
        admitted: list[Request] = []
        batch_lora_ids = {req.lora_id for req in running if req.lora_id is not None}
        num_prefill_tokens = 0
        num_free_pages = pages.num_free
        blocked: Request | None = None  # the blocked head, see the module docstring
        draining_lora_id: int | None = None
        for req in waiting:
            num_reserved_places = 0 if blocked is None else 1
            num_reserved_pages = 0 if blocked is None else blocked.num_pages_needed(self.page_size)
            if len(running) + len(admitted) + num_reserved_places >= self.max_running_requests:
                break
            if admitted and num_prefill_tokens + len(req.prompt_ids) > self.max_prefill_tokens:
                break
            num_pages = req.num_pages_needed(self.page_size)
            if num_pages + num_reserved_pages > num_free_pages:
                break
            if req.lora_id is not None:
                if req.lora_id == draining_lora_id:
                    continue
                if not slots.can_place(batch_lora_ids | {req.lora_id}):
                    if blocked is None:
                        blocked = req
                        draining_lora_id = self._pick_draining(list(running) + admitted, slots)
                    continue
                batch_lora_ids.add(req.lora_id)
            admitted.append(req)
            num_prefill_tokens += len(req.prompt_ids)
            num_free_pages -= num_pages
        return admitted

    @staticmethod
    def _pick_draining(batch: Iterable[Request], slots: SlotPlanner) -> int | None:
        """The unpinned adapter in the batch whose requests all finish soonest, worst case."""
        drain_steps: dict[int, int] = {}
        for req in batch:
            if req.lora_id is not None and not slots.is_pinned(req.lora_id):
                drain_steps[req.lora_id] = max(drain_steps.get(req.lora_id, 0), req.num_remaining_tokens)
        if not drain_steps:
            return None
        return min(drain_steps, key=lambda lora_id: (drain_steps[lora_id], lora_id))
