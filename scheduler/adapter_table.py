"""AdapterTable: which adapter ids every rank has loaded, and the loads still waiting on the ranks' reports.

A load is an operation (`op_id`) sent to every rank; each rank answers it with one report naming the operation.
An adapter counts as loaded only when every rank loaded it. A load that some rank has not answered by its deadline
fails, naming the ranks, and everything it loaded anywhere is dropped everywhere (a late report is then ignored, and
the late rank's own install of a dropped id keeps nothing). Time is passed in, so tests drive it with plain numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from loraplex.protocol.structs import (
    AdapterOpDone,
    AdapterOutcome,
    AdapterReport,
    AdapterToLoad,
    DropAdapters,
    LoadAdapters,
)

log = logging.getLogger(__name__)


@dataclass
class LoadFinished:
    """A load the ranks have answered (or that timed out): the reply and, if anything must go, the rollback."""

    reply: AdapterOpDone
    loaded: list[AdapterToLoad] = field(default_factory=list)  # now loaded on every rank
    rollback: DropAdapters | None = None  # to every rank


@dataclass
class _PendingLoad:
    op: LoadAdapters
    deadline: float
    reports: dict[int, AdapterReport] = field(default_factory=dict)  # tp rank -> its report


class AdapterTable:
    def __init__(self, num_ranks: int, load_timeout_s: float):
        self.num_ranks = num_ranks
        self.load_timeout_s = load_timeout_s
        self.loaded_ids: set[int] = set()
        self._pending: dict[int, _PendingLoad] = {}  # op_id -> load

    def is_loaded(self, lora_id: int) -> bool:
        return lora_id in self.loaded_ids

    def remove(self, lora_id: int) -> bool:
        if lora_id not in self.loaded_ids:
            return False
        self.loaded_ids.remove(lora_id)
        return True

    def begin_load(self, op: LoadAdapters, now: float) -> LoadAdapters | LoadFinished:
        """What to send every rank's loader, or, when the operation is malformed, its reply at once."""
        pending_ids = {a.lora_id for load in self._pending.values() for a in load.op.adapters}
        ids = [a.lora_id for a in op.adapters]
        reused = [i for i in ids if i in self.loaded_ids or i in pending_ids or ids.count(i) > 1]
        if op.op_id in self._pending or reused:
            error = f"operation {op.op_id} reuses an operation id or lora ids {sorted(set(reused))}"
            return LoadFinished(reply=_done(op, [_failure(a.lora_id, error, "internal") for a in op.adapters]))
        self._pending[op.op_id] = _PendingLoad(op=op, deadline=now + self.load_timeout_s)
        return op

    def add_report(self, report: AdapterReport) -> LoadFinished | None:
        """Record one rank's report; when it completes its load, the load's outcome."""
        load = self._pending.get(report.op_id)
        if load is None or not 0 <= report.tp_rank < self.num_ranks:
            log.warning("adapter report of op %d from rank %d matches no load in progress; ignored",
                        report.op_id, report.tp_rank)
            return None
        load.reports[report.tp_rank] = report
        if len(load.reports) < self.num_ranks:
            return None
        del self._pending[report.op_id]
        return self._merge(load)

    def expire(self, now: float) -> list[LoadFinished]:
        """Fail the loads whose deadline passed."""
        expired = [load for load in self._pending.values() if now >= load.deadline]
        for load in expired:
            del self._pending[load.op.op_id]
        return [self._merge(load) for load in expired]

    def _merge(self, load: _PendingLoad) -> LoadFinished:
        missing = [rank for rank in range(self.num_ranks) if rank not in load.reports]
        outcomes, loaded, rollback_ids = [], [], []
        for adapter in load.op.adapters:
            per_rank = {rank: _find(report, adapter.lora_id) for rank, report in sorted(load.reports.items())}
            outcome = self._merge_one(adapter, per_rank, missing)
            outcomes.append(outcome)
            if outcome.success:
                self.loaded_ids.add(adapter.lora_id)
                loaded.append(adapter)
            elif missing or any(o.success for o in per_rank.values()):
                rollback_ids.append(adapter.lora_id)  # some rank holds it, or may still install it
        rollback = DropAdapters(op_id=load.op.op_id, lora_ids=rollback_ids) if rollback_ids else None
        return LoadFinished(reply=_done(load.op, outcomes), loaded=loaded, rollback=rollback)

    def _merge_one(
        self, adapter: AdapterToLoad, per_rank: dict[int, AdapterOutcome], missing: list[int]
    ) -> AdapterOutcome:
        if missing:
            ranks = ", ".join(str(rank) for rank in missing)
            error = (
                f"adapter {adapter.lora_name!r}: rank {ranks} did not answer within "
                f"--lora-load-timeout {self.load_timeout_s:g} s; rolled back on every rank"
            )
            return _failure(adapter.lora_id, error, "timeout")
        failures = {rank: o for rank, o in per_rank.items() if not o.success}
        if not failures:
            first = per_rank[0]
            return AdapterOutcome(
                lora_id=adapter.lora_id, success=True, rank=first.rank, target_modules=first.target_modules
            )
        messages = {o.error_message for o in failures.values()}
        if len(failures) == self.num_ranks and len(messages) == 1:
            error = messages.pop()  # every rank says the same: no need to name them
        else:
            error = "; ".join(f"rank {rank}: {o.error_message}" for rank, o in failures.items())
        kind = failures[min(failures)].error_kind  # the first failing rank's reason
        return _failure(adapter.lora_id, error, kind)


def _find(report: AdapterReport, lora_id: int) -> AdapterOutcome:
    for outcome in report.outcomes:
        if outcome.lora_id == lora_id:
            return outcome
    return _failure(lora_id, "no outcome for this adapter in the rank's report", "internal")


def _failure(lora_id: int, message: str, kind: str) -> AdapterOutcome:
    return AdapterOutcome(lora_id=lora_id, success=False, error_message=message, error_kind=kind)


def _done(op: LoadAdapters, outcomes: list[AdapterOutcome]) -> AdapterOpDone:
    return AdapterOpDone(op_id=op.op_id, outcomes=outcomes)
