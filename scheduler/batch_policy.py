"""BatchPolicy: which waiting requests join the next forward pass (every running request decodes anyway).

Waiting requests (new ones, and preempted ones) are admitted in the order given (AdmissionOrder: by arrival, fair
share between adapters, priority), while
- the running requests stay within max_running_requests,
- the step's prefill token budget lasts, and the pages for the request's first chunk can be had (`Admission`:
  the scheduler matches its cached prefix, cuts the chunk and allocates the pages),
- the batch's distinct adapters fit the slots (SlotPlanner.can_place),
- the adapter's running requests stay within max_running_per_adapter (a request past it is passed over, as one
  waiting for a slot is, and waits for its own adapter's requests to finish).
A request that fails one of the first two stops admission for this step: nobody overtakes it, and since the
running requests only drain, it gets in once enough of them finish.

No starvation on slots. The first request that fits everything but the slots is the *blocked head*. Requests behind
it may still go ahead when they need no new slot (base model, or an adapter already in the batch), with two limits:
- they leave one running place and the blocked head's first-chunk pages free, so the head needs only a slot;
- none may use the *draining* adapter: of the unpinned adapters in the batch, the one whose requests finish soonest
  (fewest remaining tokens, worst case). Its hold only shrinks, so its slot frees up for the blocked head.
Bound: each step the draining adapter's worst-case remaining tokens drop by one (it is re-chosen as the minimum every
step, which can only be lower), so a request that is the blocked head at step t is admitted by step t + D + 1, where
D = the draining adapter's remaining tokens at step t <= the largest max_new_tokens among running requests.
An unpinned adapter in the batch always exists when the head is blocked: at most num_slots - 1 adapters are pinned.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Protocol

from loraplex.scheduler.request import Request
from loraplex.scheduler.slot_planner import SlotPlanner


class Admission(Protocol):
    def pages_wanted(self, req: Request) -> int:
        """Pages the request's first chunk would need now, changing nothing."""

    def try_admit(self, req: Request, keep_free_pages: int) -> bool:
        """Take the request's cached prefix and pages for its first chunk, leaving keep_free_pages; False: no room
        (tokens or pages) this step, and nothing was taken."""


class BatchPolicy:
    def __init__(self, *, max_running_requests: int, max_running_per_adapter: int | None = None):
        self.max_running_requests = max_running_requests
        self.max_running_per_adapter = max_running_per_adapter

    def pick_prefills(
        self, waiting: Iterable[Request], running: Sequence[Request], slots: SlotPlanner, admission: Admission
    ) -> list[Request]:
        admitted: list[Request] = []
        batch_lora_ids = {req.lora_id for req in running if req.lora_id is not None}
        num_running = Counter(req.lora_id for req in running if req.lora_id is not None)
        blocked: Request | None = None  # the blocked head, see the module docstring
        num_reserved_pages = 0
        draining_lora_id: int | None = None
        for req in waiting:
            num_reserved_places = 0 if blocked is None else 1
            if len(running) + len(admitted) + num_reserved_places >= self.max_running_requests:
                break
            if req.lora_id is not None:
                if req.lora_id == draining_lora_id or num_running[req.lora_id] == self.max_running_per_adapter:
                    continue
                if not slots.can_place(batch_lora_ids | {req.lora_id}):
                    if blocked is None:
                        blocked = req
                        num_reserved_pages = admission.pages_wanted(req)
                        draining_lora_id = self._pick_draining(list(running) + admitted, slots)
                    continue
            if not admission.try_admit(req, num_reserved_pages):
                break
            if req.lora_id is not None:
                batch_lora_ids.add(req.lora_id)
                num_running[req.lora_id] += 1
            admitted.append(req)
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
