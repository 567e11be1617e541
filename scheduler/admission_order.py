"""AdmissionOrder: the order in which waiting requests are offered to BatchPolicy, and which running request a
preemption takes.

- `--scheduling-policy priority`: by the request's priority, lower first (vLLM's); fcfs treats every priority as 0.
- Within one priority: fair share between clients (FairShare, a client being an API key and adapter pair), each
  client's requests by arrival; with `--disable-adapter-fairness`, by arrival alone.
- A preemption takes the newest running request, or under the priority policy the lowest priority's newest.
The counters are charged here: a request's prompt on its first admission (a recompute after a preemption is the
scheduler's doing, not the client's), its output tokens as they come.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from loraplex.scheduler.fair_share import OUTPUT_WEIGHT, PROMPT_WEIGHT, FairShare
from loraplex.scheduler.request import Request


class AdmissionOrder:
    def __init__(self, *, by_priority: bool, is_fair: bool):
        self.by_priority = by_priority
        self.share = FairShare() if is_fair else None

    def _priority(self, req: Request) -> int:
        return req.priority if self.by_priority else 0

    def order(self, waiting: Iterable[Request]) -> list[Request]:
        queue = sorted(waiting, key=lambda r: (self._priority(r), r.arrival))
        if self.share is None:
            return queue
        levels = itertools.groupby(queue, key=self._priority)
        return [req for _, level in levels for req in self.share.order(list(level), _client, _prompt_cost)]

    def victim(self, running: Iterable[Request]) -> Request:
        return max(running, key=lambda r: (self._priority(r), r.arrival))

    # ---- the counters (no-ops without fairness) ----------------------------------------------------------------

    def on_wait(self, req: Request) -> None:
        """The request entered the waiting queue (new, or preempted)."""
        if self.share is not None:
            self.share.join(req.client)

    def on_leave(self, req: Request) -> None:
        """The request left the waiting queue without being admitted (aborted, failed)."""
        if self.share is not None:
            self.share.leave(req.client)

    def on_admit(self, req: Request) -> None:
        if self.share is not None:
            self.share.leave(req.client)
            if not req.num_preemptions:
                self.share.charge(req.client, _prompt_cost(req))

    def on_output(self, req: Request) -> None:
        if self.share is not None:
            self.share.charge(req.client, OUTPUT_WEIGHT)

    def forget_adapter(self, lora_id: int) -> None:
        if self.share is not None:
            self.share.forget(lambda client: client[1] == lora_id)

    @property
    def num_backlogged(self) -> int:
        """Clients with waiting requests, as the counters see them (0 when the queue is empty: nothing leaked)."""
        return 0 if self.share is None else self.share.num_backlogged


def _client(req: Request) -> tuple[str | None, int | None]:
    return req.client


def _prompt_cost(req: Request) -> int:
    return PROMPT_WEIGHT * len(req.prompt_ids)
