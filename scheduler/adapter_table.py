"""AdapterTable: which adapter ids every rank has loaded, and the loads still waiting on the ranks' reports.

A load is an operation (`op_id`) sent to every rank; each rank answers it with one report naming the operation.
An adapter counts as loaded only when every rank loaded it. A load that some rank has not answered by its deadline
fails, naming the ranks, and everything it loaded anywhere is dropped everywhere (a late report is then ignored, and
the late rank's own install of a dropped id keeps nothing). Time is passed in, so tests drive it with plain numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from loraplex.protocol.adapters.adapter_outcomes import merge_outcomes
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
        adapters = load.op.adapters
        missing = [rank for rank in range(self.num_ranks) if rank not in load.reports]
        ids = [a.lora_id for a in adapters]
        if missing:  # a rank may still install them: everything goes again, everywhere
            ranks = ", ".join(str(rank) for rank in missing)
            why = f"did not answer within --lora-load-timeout {self.load_timeout_s:g} s; rolled back on every rank"
            outcomes = [_failure(a.lora_id, f"adapter {a.lora_name!r}: rank {ranks} {why}", "timeout")
                        for a in adapters]  # fmt: skip
            return LoadFinished(reply=_done(load.op, outcomes), rollback=DropAdapters(op_id=load.op.op_id,
                                                                                      lora_ids=ids))
        answers = [[_find(load.reports[rank], i) for i in ids] for rank in range(self.num_ranks)]
        outcomes, held = merge_outcomes(ids, answers, [f"rank {rank}: " for rank in range(self.num_ranks)])
        loaded = [a for a, outcome in zip(adapters, outcomes, strict=True) if outcome.success]
        self.loaded_ids.update(a.lora_id for a in loaded)
        held_ids = {i for rank_ids in held.values() for i in rank_ids}  # some rank holds a failed one
        rollback_ids = [i for i in ids if i in held_ids]
        rollback = DropAdapters(op_id=load.op.op_id, lora_ids=rollback_ids) if rollback_ids else None
        return LoadFinished(reply=_done(load.op, outcomes), loaded=loaded, rollback=rollback)


def _find(report: AdapterReport, lora_id: int) -> AdapterOutcome:
    for outcome in report.outcomes:
        if outcome.lora_id == lora_id:
            return outcome
    return _failure(lora_id, "no outcome for this adapter in the rank's report", "internal")


def _failure(lora_id: int, message: str, kind: str) -> AdapterOutcome:
    return AdapterOutcome(lora_id=lora_id, success=False, error_message=message, error_kind=kind)


def _done(op: LoadAdapters, outcomes: list[AdapterOutcome]) -> AdapterOpDone:
    return AdapterOpDone(op_id=op.op_id, outcomes=outcomes)
