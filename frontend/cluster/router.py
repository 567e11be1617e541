"""Router: which data-parallel replica (--dp-size) a request goes to. Plain ints, so every rule is unit-tested.

A request for an adapter goes to a replica that holds it: in a device slot (the scheduler's last `SlotsChanged`), or
with requests for it in flight there (they are bringing it into a slot). Otherwise, and for base requests, it goes to
the least loaded replica; load = requests routed there and not finished, i.e. the scheduler's running + waiting.

No starvation: a holder is chosen only while its load is at most `slack` above the least loaded replica's. So no
request queues behind more than `slack` extra requests for the sake of adapter affinity, and an adapter too popular
for one replica spreads to the others (each then holds it). Among equals the choice goes round robin, so no replica
is passed over while it is among the least loaded.
"""

from __future__ import annotations

from collections import Counter

# A request may wait behind this many more requests than on the least loaded replica to find its adapter resident.
ROUTE_SLACK = 4


class Router:
    def __init__(self, num_replicas: int, slack: int = ROUTE_SLACK):
        if num_replicas < 1 or slack < 0:
            raise ValueError(f"bad router size: {num_replicas} replicas, slack {slack}")
        self.num_replicas = num_replicas
        self.slack = slack
        self.loads = [0] * num_replicas  # requests routed and not finished, per replica
        self.num_routed = [0] * num_replicas  # since start, per replica
        self._in_flight = [Counter() for _ in range(num_replicas)]  # per replica: lora_id -> requests in flight
        self._resident: list[set[int]] = [set() for _ in range(num_replicas)]  # per replica: lora_ids in slots
        self._cursor = 0  # round robin among equals starts here

    def pick(self, lora_id: int | None) -> int:
        least = min(self.loads)
        if lora_id is not None:
            holders = [
                r for r in range(self.num_replicas) if self.holds(r, lora_id) and self.loads[r] <= least + self.slack
            ]
            if holders:
                return min(holders, key=lambda r: (self.loads[r], self._turn(r)))
        chosen = min((r for r in range(self.num_replicas) if self.loads[r] == least), key=self._turn)
        self._cursor = (chosen + 1) % self.num_replicas
        return chosen

    def _turn(self, dp_rank: int) -> int:
        return (dp_rank - self._cursor) % self.num_replicas

    def holds(self, dp_rank: int, lora_id: int) -> bool:
        return lora_id in self._resident[dp_rank] or self._in_flight[dp_rank][lora_id] > 0

    def acquire(self, dp_rank: int, lora_id: int | None) -> None:
        """A request was sent to dp_rank."""
        self.loads[dp_rank] += 1
        self.num_routed[dp_rank] += 1
        if lora_id is not None:
            self._in_flight[dp_rank][lora_id] += 1

    def release(self, dp_rank: int, lora_id: int | None) -> None:
        """A request acquired on dp_rank ended (every path)."""
        self.loads[dp_rank] -= 1
        if lora_id is not None:
            self._in_flight[dp_rank][lora_id] -= 1
            if not self._in_flight[dp_rank][lora_id]:
                del self._in_flight[dp_rank][lora_id]

    def set_resident(self, dp_rank: int, slot_lora_ids: list[int]) -> None:
        """dp_rank's device slot table (-1 = empty), as its scheduler last reported it."""
        self._resident[dp_rank] = {lora_id for lora_id in slot_lora_ids if lora_id != -1}
