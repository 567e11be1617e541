"""ReplicaSet: the frontend's data-parallel replicas (--dp-size), each a scheduler behind its own SchedulerClient.

A request goes to one replica (router.py picks it). An adapter operation goes to every replica under one
operation id, and an adapter counts as loaded only when every replica loaded it: `merge_replica_answers` turns the
replicas' answers into one outcome per adapter, naming the replica that failed or did not answer, and the ids each
replica must drop again. With one replica, messages name no replica and nothing is merged beyond what its scheduler
says.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from loraplex.frontend.cluster.scheduler_client import SchedulerClient
from loraplex.protocol.adapters.adapter_outcomes import merge_outcomes
from loraplex.protocol.errors import ServerError
from loraplex.protocol.structs import (
    AdapterOutcome,
    Endpoints,
    SchedulerReady,
    SchedulerStats,
    SlotsChanged,
    TokenDeltas,
)


class ReplicaSet:
    def __init__(
        self,
        endpoints: list[Endpoints],
        on_deltas: Callable[[TokenDeltas], Any],
        on_slots: Callable[[int, SlotsChanged], None],
        on_failure: Callable[[str], None],
    ):
        self._op_ids = itertools.count(1)  # one counter: an operation has one id on every replica
        self.clients = [
            SchedulerClient(
                ep,
                on_deltas,
                functools.partial(self._named_failure, dp_rank, on_failure),
                functools.partial(on_slots, dp_rank),
                self._op_ids,
            )
            for dp_rank, ep in enumerate(endpoints)
        ]

    def __len__(self) -> int:
        return len(self.clients)

    def who(self, dp_rank: int) -> str:
        """How a message names a replica: not at all when there is only one."""
        return f"replica {dp_rank}: " if len(self.clients) > 1 else ""

    def _named_failure(self, dp_rank: int, on_failure: Callable[[str], None], reason: str) -> None:
        on_failure(self.who(dp_rank) + reason)

    async def wait_ready(self, dead: Callable[[], tuple[str, int] | None], timeout_s: float) -> list[SchedulerReady]:
        """Every scheduler's ready message, by dp_rank; raises (naming the replica) if any fails first."""

        async def one(dp_rank: int, client: SchedulerClient) -> SchedulerReady:
            try:
                return await client.wait_ready(dead, timeout_s)
            except RuntimeError as e:
                raise RuntimeError(f"{self.who(dp_rank)}{e}") from None

        tasks = [asyncio.ensure_future(one(r, c)) for r, c in enumerate(self.clients)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    def next_op_id(self) -> int:
        return next(self._op_ids)

    async def send(self, dp_rank: int, msg: Any) -> None:
        await self.clients[dp_rank].send(msg)

    async def call(self, dp_rank: int, msg: Any, timeout_s: float, frames: Sequence[Any] = ()) -> Any:
        """One replica's reply to a control message; its ServerError names the replica."""
        try:
            return await self.clients[dp_rank].call(msg, timeout_s, frames)
        except ServerError as e:
            if len(self.clients) == 1:
                raise
            raise ServerError(f"{self.who(dp_rank)}{e}", e.kind) from None

    async def call_all(self, msg: Any, timeout_s: float, frames: Sequence[Any] = ()) -> list[Any]:
        """The same control message to every replica at once: per replica its reply or the ServerError it got."""
        replies = await asyncio.gather(
            *[self.call(r, msg, timeout_s, frames) for r in range(len(self.clients))], return_exceptions=True
        )
        for reply in replies:
            if isinstance(reply, BaseException) and not isinstance(reply, ServerError):
                raise reply
        return replies

    async def stats(self) -> list[SchedulerStats]:
        return list(await asyncio.gather(*[client.stats() for client in self.clients]))

    def fail_pending(self, reason: str) -> None:
        for client in self.clients:
            client.fail_pending(reason)

    async def close(self, send_shutdown: bool) -> None:
        await asyncio.gather(*[client.close(send_shutdown) for client in self.clients])

    def close_sockets(self) -> None:
        for client in self.clients:
            client.close_sockets()


def merge_replica_answers(
    lora_ids: list[int], answers: list[list[AdapterOutcome] | ServerError], who: Callable[[int], str]
) -> tuple[list[AdapterOutcome], dict[int, list[int]]]:
    """One load's answers, per replica (its outcomes in adapter order, or the ServerError its call ended with, which
    names it already), merged all-or-nothing (protocol's merge_outcomes); and per dp_rank the ids to drop again:
    what it loaded of an adapter that failed elsewhere, and everything from a replica that did not answer in time
    (it may still load them)."""
    rows = [
        [AdapterOutcome(lora_id=i, success=False, error_message=str(a), error_kind=a.kind) for i in lora_ids]
        if isinstance(a, ServerError)
        else a
        for a in answers
    ]
    names = ["" if isinstance(a, ServerError) else who(dp_rank) for dp_rank, a in enumerate(answers)]
    outcomes, rollback = merge_outcomes(lora_ids, rows, names)
    for dp_rank, answer in enumerate(answers):
        if isinstance(answer, ServerError) and answer.kind == "timeout":
            rollback[dp_rank] = list(lora_ids)
    return outcomes, rollback
