"""FairShare: the order in which waiting requests are offered for admission, by virtual token counters (VTC: Sheng et
al., "Fairness in Serving Large Language Models", OSDI 2024).

A client (an adapter, per API key where keys are in use) has a counter of the service it received: PROMPT_WEIGHT per
prompt token when a request is first admitted, OUTPUT_WEIGHT per output token as it is produced (the paper's cost
h = w_p * n_p + w_q * n_q with its weights 1 and 2). Admission offers the head of the backlogged client with the
least counter first, so a client that sent ten times as much waits behind nobody else's first request.

Idle time is not banked (the paper's lift): a client that joins the backlog starts at no less than the least counter
of the clients already backlogged (or, with none, the counter of the last one to leave), so a client idle for an hour
does not then take the whole server for as long.

Bound (the invariant tests/unit/test_fair_share.py checks on plain ints). Let admission take requests in this order
(nothing blocks the client offered first), and u, v be two clients backlogged since they joined with equal counters,
or since u was admitted after v joined. Then, while both stay backlogged,
    c_u - c_v <= B,  B = R * (PROMPT_WEIGHT * L + OUTPUT_WEIGHT * M),
where R is the most requests one client can have running, L the longest prompt and M the most output tokens of one
request. Why: when u was last admitted its counter was the least (c_u <= c_v then, and c_v only grows); after that c_u
grows only by the charges of its requests admitted until then, at most R of them running, each charging at most
PROMPT_WEIGHT * L + OUTPUT_WEIGHT * M. So over any interval in which both stay backlogged their service (the growth of
their counters) differs by at most 2B, whatever rate each sends at.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

PROMPT_WEIGHT = 1
OUTPUT_WEIGHT = 2

T = TypeVar("T")


class FairShare:
    def __init__(self) -> None:
        self._counters: dict[Hashable, int] = {}
        self._num_waiting: dict[Hashable, int] = {}  # the backlog: clients with waiting requests, and how many
        self._last_left = 0  # the counter of the last client to leave the backlog

    def counter(self, client: Hashable) -> int:
        return self._counters.get(client, 0)

    @property
    def num_backlogged(self) -> int:
        return len(self._num_waiting)

    def join(self, client: Hashable) -> None:
        """A request of the client enters the waiting queue (new, or preempted)."""
        if client not in self._num_waiting:
            floor = min((self.counter(c) for c in self._num_waiting), default=self._last_left)
            self._counters[client] = max(self.counter(client), floor)
        self._num_waiting[client] = self._num_waiting.get(client, 0) + 1

    def leave(self, client: Hashable) -> None:
        """A request of the client leaves the waiting queue (admitted, aborted or failed while waiting)."""
        self._num_waiting[client] -= 1
        if not self._num_waiting[client]:
            del self._num_waiting[client]
            self._last_left = self.counter(client)

    def charge(self, client: Hashable, cost: int) -> None:
        self._counters[client] = self.counter(client) + cost

    def forget(self, is_gone: Callable[[Hashable], bool]) -> None:
        """Drop the counters of clients that can never send again (an unloaded adapter's: ids are never reused)."""
        for client in [c for c in self._counters if is_gone(c) and c not in self._num_waiting]:
            del self._counters[client]

    def order(self, waiting: Sequence[T], client_of: Callable[[T], Hashable], cost_of: Callable[[T], int]) -> list[T]:
        """The waiting requests (in arrival order) in the order to offer them: each next one is the oldest request of
        the client whose counter, plus the costs of its requests ordered before, is least (ties: the older head).
        Costs are only counted here; charge() charges what is admitted."""
        queues: dict[Hashable, list[int]] = {}
        for index, item in enumerate(waiting):
            queues.setdefault(client_of(item), []).append(index)
        heap = [(self.counter(client), indices[0], client, 0) for client, indices in queues.items()]
        heapq.heapify(heap)
        ordered: list[T] = []
        while heap:
            tentative, index, client, position = heapq.heappop(heap)
            ordered.append(waiting[index])
            indices = queues[client]
            if position + 1 < len(indices):
                cost = cost_of(waiting[index])
                heapq.heappush(heap, (tentative + cost, indices[position + 1], client, position + 1))
        return ordered
