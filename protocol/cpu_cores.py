"""CorePlan: which cores a CPU server's compute threads run on, and which the frontend and the scheduler keep to.

A decode step on the CPU runs torch's thread pool over every weight; a pool thread descheduled for the frontend's
or the scheduler's work holds every other thread at the next barrier. So each worker's threads are sized once and
pinned to cores of their own, and where the machine has a core to spare the frontend and scheduler keep to it.

vLLM's VLLM_CPU_OMP_THREADS_BIND names the cores: `auto` (the default: pinned where there are at least
MIN_CORES_PER_WORKER cores per local worker beside one for the frontend and scheduler, else not), `nobind` or `all`
(not pinned), or explicit lists, one per local worker separated by `|`: `0-7|8-15`, `0,2,4-6`. Plain ints: the
scheduler imports this too, and it never imports torch."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# Below this many cores per worker a pinned thread gains nothing and can no longer move off a core another process
# keeps busy (a shared machine), so `auto` leaves the threads unpinned there.
MIN_CORES_PER_WORKER = 2


@dataclass(frozen=True)
class CorePlan:
    num_threads: int  # each worker's torch threads
    worker_cores: tuple[tuple[int, ...], ...]  # per local worker; empty: not pinned
    service_cores: tuple[int, ...]  # the frontend's and scheduler's; empty: not restricted
    why: str  # for the start-up log

    def describe(self, local_index: int) -> str:
        if not self.worker_cores:
            return f"{self.num_threads} compute threads, not pinned ({self.why})"
        services = format_cores(self.service_cores) if self.service_cores else "any core"
        return (f"{self.num_threads} compute threads pinned to cores {format_cores(self.worker_cores[local_index])}; "
                f"frontend and scheduler on {services} ({self.why})")


def parse_cores(text: str) -> tuple[int, ...]:
    """`0-3,6` -> (0, 1, 2, 3, 6); ValueError naming the part that is not a core list."""
    cores: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            cores.extend(range(int(first), int(last or first) + 1))
        except ValueError:
            raise ValueError(f"{BIND_ENV}: {part!r} is not a core or a range of cores") from None
    if not cores or len(set(cores)) != len(cores):
        raise ValueError(f"{BIND_ENV}: {text!r} names no cores, or a core twice")
    return tuple(cores)


def format_cores(cores: Sequence[int]) -> str:
    """(0, 1, 2, 3) -> `0-3`; (0, 2) -> `0,2`; (5,) -> `5`."""
    if len(cores) > 1 and list(cores) == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def plan_cores(available: Sequence[int], num_workers: int, bind: str | None = None) -> CorePlan:
    """The plan for `num_workers` workers on this host, given the cores this process may run on and the bind setting."""
    available = sorted(available)
    bind = (bind or "auto").strip()
    unpinned_threads = max(1, (len(available) - 1) // num_workers)  # one core left to the frontend and scheduler
    if bind in ("nobind", "all"):
        return CorePlan(unpinned_threads, (), (), f"{BIND_ENV}={bind}")
    if bind != "auto":
        lists = tuple(parse_cores(part) for part in bind.split("|"))
        if len(lists) != num_workers:
            raise ValueError(f"{BIND_ENV}={bind!r} names {len(lists)} core lists for {num_workers} local workers")
        used = [core for cores in lists for core in cores]
        if len(set(used)) != len(used):
            raise ValueError(f"{BIND_ENV}={bind!r} gives a core to two workers")
        rest = tuple(core for core in available if core not in set(used))
        return CorePlan(min(map(len, lists)), lists, rest, f"{BIND_ENV}={bind}")
    if len(available) < num_workers * MIN_CORES_PER_WORKER + 1:
        return CorePlan(unpinned_threads, (), (), f"{len(available)} cores for {num_workers} worker(s): none to spare")
    per_worker = (len(available) - 1) // num_workers
    # the first core to the frontend and scheduler (with what is left over), the rest split in contiguous runs
    lists = tuple(tuple(available[1 + i * per_worker: 1 + (i + 1) * per_worker]) for i in range(num_workers))
    rest = (available[0], *available[1 + num_workers * per_worker:])
    return CorePlan(per_worker, lists, rest, f"{BIND_ENV}=auto")


def pin_to(cores: Sequence[int]) -> None:
    """Keep this process (and the threads it starts after) to `cores`; nothing for an empty list."""
    if cores:
        os.sched_setaffinity(0, cores)
