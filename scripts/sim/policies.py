"""The cluster simulator's routers (scripts/sim/cluster.py): each picks a replica for a request's adapter from what a
router of that kind can see. Ties go to the lowest index unless said otherwise.

`ProductRouter` is loraplex's own `--dp-size` routing, the frontend's `Router` itself, fed the events the frontend
feeds it; the others are baselines: round robin, least loaded, and the Gateway API Inference Extension's scorer."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from loraplex.frontend.cluster.router import Router

if TYPE_CHECKING:
    from scripts.sim.cluster import Replica


class Policy:
    """A router reads the replicas' state at pick time; one that keeps its own state also hears, as loraplex's
    frontend does, when a request it routed ends and when a replica's slot table changes."""

    def pick(self, replicas: list[Replica], adapter: int | None) -> int:
        raise NotImplementedError

    def finished(self, replica: int, adapter: int | None) -> None:
        pass

    def slots_changed(self, replica: int, slot_lora_ids: list[int]) -> None:
        pass


class RoundRobin(Policy):
    def __init__(self, rng: random.Random):
        self.next = 0

    def pick(self, replicas: list[Replica], adapter: int | None) -> int:
        self.next = (self.next + 1) % len(replicas)
        return (self.next - 1) % len(replicas)


class LeastLoaded(Policy):
    def __init__(self, rng: random.Random):
        pass

    def pick(self, replicas: list[Replica], adapter: int | None) -> int:
        return min(replicas, key=lambda r: r.load).index


class ProductRouter(Policy):
    """loraplex's --dp-size routing: `loraplex.frontend.cluster.router.Router`, told what the frontend tells it (a
    request routed, a request ended, a replica's new slot table), so the simulation routes exactly as the server
    does."""

    def __init__(self, rng: random.Random):
        self.router: Router | None = None  # sized at the first pick, when the replicas are known

    def pick(self, replicas: list[Replica], adapter: int | None) -> int:
        if self.router is None:
            self.router = Router(len(replicas))
        dp_rank = self.router.pick(adapter)
        self.router.acquire(dp_rank, adapter)  # the frontend acquires as it sends the request
        return dp_rank

    def finished(self, replica: int, adapter: int | None) -> None:
        self.router.release(replica, adapter)

    def slots_changed(self, replica: int, slot_lora_ids: list[int]) -> None:
        self.router.set_resident(replica, slot_lora_ids)


class LoRAAffinityScorer(Policy):
    """The Gateway API Inference Extension's endpoint picker as deploy/k8s configures it: queue-scorer (1) +
    kv-cache-utilization-scorer (1) + lora-affinity-scorer (2), max score, ties broken at random. LoRA affinity reads
    vllm:lora_requests_info: 1.0 if the adapter is running there, 0.8 if running + waiting adapters < max_lora,
    0.6 if it is waiting there, else 0."""

    WEIGHTS = (1.0, 1.0, 2.0)  # queue, kv cache, lora affinity

    def __init__(self, rng: random.Random):
        self.rng = rng

    def pick(self, replicas: list[Replica], adapter: int | None) -> int:
        queues = [len(r.scheduler.waiting) + sum(r.reading.values()) for r in replicas]
        low, high = min(queues), max(queues)
        best: list[int] = []
        best_score = -math.inf
        for r, queue in zip(replicas, queues, strict=True):
            queue_score = 1.0 if high == low else (high - queue) / (high - low)
            score = self.WEIGHTS[0] * queue_score + self.WEIGHTS[1] * (1 - r.kv_usage)
            score += self.WEIGHTS[2] * self._affinity(r, adapter)
            if score > best_score + 1e-12:
                best, best_score = [r.index], score
            elif abs(score - best_score) <= 1e-12:
                best.append(r.index)
        return self.rng.choice(best)

    @staticmethod
    def _affinity(r: Replica, adapter: int | None) -> float:
        if adapter is None:
            return 1.0  # the base model is everywhere
        running, waiting = r.running_adapters(), r.waiting_adapters()
        if adapter in running:
            return 1.0
        if len(running) + len(waiting) < r.shape.num_slots:
            return 0.8
        return 0.6 if adapter in waiting else 0.0


POLICIES: dict[str, Callable[[random.Random], Policy]] = {
    "round robin": RoundRobin,
    "least loaded": LeastLoaded,
    "loraplex Router": ProductRouter,
    "gateway LoRA affinity": LoRAAffinityScorer,
}
