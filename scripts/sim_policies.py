"""The cluster simulator's routers (scripts/cluster_sim.py): each picks a replica for a request's adapter from what a
router of that kind can see. Ties go to the lowest index unless said otherwise."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scripts.cluster_sim import Replica


class RoundRobin:
    def __init__(self, rng: random.Random):
        self.next = 0

    def pick(self, replicas: list[Replica], adapter: int | None) -> int:
        self.next = (self.next + 1) % len(replicas)
        return (self.next - 1) % len(replicas)


class LeastLoaded:
    def __init__(self, rng: random.Random):
        pass

    def pick(self, replicas: list[Replica], adapter: int | None) -> int:
        return min(replicas, key=lambda r: r.load).index


class AdapterResidentFirst:
    """loraplex's --dp-size routing: a replica that already has the adapter (in a device slot, or requests for it
    queued) unless it is full (load >= its running limit), else the least loaded."""

    def __init__(self, rng: random.Random):
        pass

    def pick(self, replicas: list[Replica], adapter: int | None) -> int:
        if adapter is not None:
            holders = [r for r in replicas if r.is_resident(adapter) or adapter in r.waiting_adapters()
                       or adapter in r.running_adapters()]  # fmt: skip
            best = min(holders, key=lambda r: r.load, default=None)
            if best is not None and best.load < best.shape.max_running:
                return best.index
        return min(replicas, key=lambda r: r.load).index


class LoRAAffinityScorer:
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


POLICIES: dict[str, Callable[[random.Random], object]] = {
    "round robin": RoundRobin,
    "least loaded": LeastLoaded,
    "adapter-resident first": AdapterResidentFirst,
    "gateway LoRA affinity": LoRAAffinityScorer,
}
