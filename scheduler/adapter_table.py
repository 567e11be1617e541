"""AdapterTable: which adapter ids are loaded on every rank, and the loads still waiting on the ranks' reports.

Each rank answers the loads it is sent in the order it gets them, so the n-th report from a rank belongs to the
n-th load still missing that rank's report. An adapter counts as loaded only when every rank loaded it.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from protocol.structs import (
    DropAdapters,
    LoadLoRAAdapterReqInput,
    LoadLoRAAdapterReqOutput,
    LoRAAdapterResult,
    LoRAAdapterSpec,
    TokenDelta,
    UnloadLoRAAdapterReqOutput,
    WorkerAdapterReport,
)

log = logging.getLogger(__name__)


@dataclass
class AdapterOpDone:
    """A finished load or unload: the reply for the frontend and what else must be sent."""

    reply: LoadLoRAAdapterReqOutput | UnloadLoRAAdapterReqOutput
    drop: DropAdapters | None = None  # to every rank
    deltas: list[TokenDelta] = field(default_factory=list)  # requests failed by an unload
    pin_ids: list[int] = field(default_factory=list)  # loaded adapters to pin


@dataclass
class _PendingLoad:
    results: list[LoRAAdapterResult | None]  # one per adapter asked for, in order; None = up to the ranks
    forwarded: list[LoRAAdapterSpec]
    reports: dict[int, WorkerAdapterReport] = field(default_factory=dict)


class AdapterTable:
    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks
        self.loaded_ids: set[int] = set()
        self._pending: deque[_PendingLoad] = deque()

    def is_loaded(self, lora_id: int) -> bool:
        return lora_id in self.loaded_ids

    def remove(self, lora_id: int) -> bool:
        if lora_id not in self.loaded_ids:
            return False
        self.loaded_ids.remove(lora_id)
        return True

    @property
    def num_pending_loads(self) -> int:
        return len(self._pending)

    def begin_load(
        self, req: LoadLoRAAdapterReqInput, *, num_pinned: int, max_pinned: int
    ) -> LoadLoRAAdapterReqInput | AdapterOpDone:
        """What to send every rank, or, when nothing is left to ask them, the reply itself."""
        pending_ids = {spec.lora_id for load in self._pending for spec in load.forwarded}
        num_pinned += sum(spec.pinned for load in self._pending for spec in load.forwarded)
        results: list[LoRAAdapterResult | None] = []
        forwarded: list[LoRAAdapterSpec] = []
        for spec in req.adapters:
            error = ""
            if spec.lora_id < 0:
                error = f"adapter {spec.lora_name!r} has no lora_id (the frontend's registry mints one)"
            elif spec.lora_id in self.loaded_ids or spec.lora_id in pending_ids:
                error = f"adapter {spec.lora_name!r}: lora_id {spec.lora_id} is already loaded"
            elif spec.pinned and num_pinned >= max_pinned:
                error = f"too many pinned adapters (at most {max_pinned} = max_loras_per_batch - 1)"
            if error:
                results.append(
                    LoRAAdapterResult(
                        lora_name=spec.lora_name, success=False, error_message=error, lora_id=spec.lora_id
                    )
                )
                continue
            results.append(None)
            forwarded.append(spec)
            pending_ids.add(spec.lora_id)
            num_pinned += spec.pinned
        if not forwarded:
            return AdapterOpDone(reply=_load_reply(results))
        self._pending.append(_PendingLoad(results=results, forwarded=forwarded))
        return LoadLoRAAdapterReqInput(adapters=forwarded, load_inplace=req.load_inplace)

    def add_report(self, report: WorkerAdapterReport) -> AdapterOpDone | None:
        """Record one rank's report; when it completes a load, mark its adapters loaded and return the reply."""
        load = next((load for load in self._pending if report.rank not in load.reports), None)
        if load is None or not 0 <= report.rank < self.num_ranks:
            log.warning("adapter report from rank %d matches no load in progress; ignored", report.rank)
            return None
        load.reports[report.rank] = report
        if len(load.reports) < self.num_ranks:
            return None
        self._pending.remove(load)
        return self._merge(load)

    def _merge(self, load: _PendingLoad) -> AdapterOpDone:
        merged = iter([self._merge_one(spec, load.reports) for spec in load.forwarded])
        results = [result if result is not None else next(merged) for result in load.results]
        partial_ids = []
        for spec in load.forwarded:
            num_ok = sum(_find(report, spec).success for report in load.reports.values())
            if 0 < num_ok < self.num_ranks:
                partial_ids.append(spec.lora_id)
        pin_ids = [spec.lora_id for spec in load.forwarded if spec.pinned and spec.lora_id in self.loaded_ids]
        return AdapterOpDone(
            reply=_load_reply(results),
            drop=DropAdapters(lora_ids=partial_ids) if partial_ids else None,
            pin_ids=pin_ids,
        )

    def _merge_one(self, spec: LoRAAdapterSpec, reports: dict[int, WorkerAdapterReport]) -> LoRAAdapterResult:
        per_rank = {rank: _find(reports[rank], spec) for rank in sorted(reports)}
        failures = [(rank, result.error_message) for rank, result in per_rank.items() if not result.success]
        if not failures:
            self.loaded_ids.add(spec.lora_id)
            first = per_rank[0]
            return LoRAAdapterResult(
                lora_name=spec.lora_name,
                success=True,
                lora_id=spec.lora_id,
                rank=first.rank,
                target_modules=first.target_modules,
            )
        messages = {message for _, message in failures}
        if len(failures) == self.num_ranks and len(messages) == 1:
            error = messages.pop()  # every rank says the same: no need to name them
        else:
            error = "; ".join(f"rank {rank}: {message}" for rank, message in failures)
        kind = next(per_rank[rank].error_kind for rank, _ in failures)  # the first failing rank's reason
        return LoRAAdapterResult(
            lora_name=spec.lora_name, success=False, error_message=error, error_kind=kind, lora_id=spec.lora_id
        )


def _find(report: WorkerAdapterReport, spec: LoRAAdapterSpec) -> LoRAAdapterResult:
    for result in report.results:
        # A rank that left lora_id unset is matched by name.
        is_match = result.lora_id == spec.lora_id if result.lora_id >= 0 else result.lora_name == spec.lora_name
        if is_match:
            return result
    return LoRAAdapterResult(
        lora_name=spec.lora_name,
        success=False,
        lora_id=spec.lora_id,
        error_message="no result for this adapter in the rank's report",
    )


def _load_reply(results: list[LoRAAdapterResult]) -> LoadLoRAAdapterReqOutput:
    errors = [f"{result.lora_name}: {result.error_message}" for result in results if not result.success]
    return LoadLoRAAdapterReqOutput(success=not errors, error_message="; ".join(errors), results=results)
