"""SchedulerClient: the frontend's end of the scheduler sockets.

Requests and aborts go out as they are; token deltas and slot tables come back to callbacks; every control message
carries an operation id, and its reply is matched by that id (replies may arrive in any order, and a late one is
dropped). Under --dp-size there is one client per replica (replica_set.py), all minting ids from one counter.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from loraplex.protocol.errors import ServerError
from loraplex.protocol.sockets import PULL, PUSH, AsyncTypedSocket
from loraplex.protocol.structs import (
    Endpoints,
    ProcessFailed,
    SchedulerReady,
    SchedulerStats,
    SchedulerStatsReq,
    SchedulerToFrontend,
    Shutdown,
    SlotsChanged,
    TokenDeltas,
)

logger = logging.getLogger("loraplex.scheduler_client")

READY_POLL_S = 0.2
STATS_TIMEOUT_S = 5.0


class SchedulerClient:
    def __init__(
        self,
        endpoints: Endpoints,
        on_deltas: Callable[[TokenDeltas], Any],
        on_failure: Callable[[str], None],
        on_slots: Callable[[SlotsChanged], None] | None = None,
        op_ids: Iterator[int] | None = None,
    ):
        self._from_scheduler = AsyncTypedSocket(
            PULL, endpoints.scheduler_to_frontend, bind=True, recv_type=SchedulerToFrontend
        )
        self._to_scheduler = AsyncTypedSocket(PUSH, endpoints.frontend_to_scheduler, bind=False)
        self._on_deltas = on_deltas
        self._on_failure = on_failure
        self._on_slots = on_slots
        self._op_ids = op_ids if op_ids is not None else itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}  # op_id -> the caller's future
        self._failure: str | None = None
        self._recv_task: asyncio.Task | None = None

    async def wait_ready(self, dead: Callable[[], tuple[str, int] | None], timeout_s: float) -> SchedulerReady:
        """The scheduler's ready message; raises if a child dies or reports failure first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            exited = dead()
            if exited is not None:  # its reason may already be queued (a worker's, sent on by the scheduler)
                failure = await self._queued_failure()
                raise RuntimeError(failure or f"{exited[0]} exited with code {exited[1]} during start-up")
            try:
                msg = await asyncio.wait_for(self._from_scheduler.recv(), timeout=READY_POLL_S)
            except asyncio.TimeoutError:
                continue
            if isinstance(msg, ProcessFailed):
                raise RuntimeError(f"{msg.who} failed to start: {msg.error_message}")
            if isinstance(msg, SchedulerReady):
                self._recv_task = asyncio.create_task(self._recv_loop())
                return msg
        raise RuntimeError(f"processes not ready after {timeout_s:.0f} s")

    async def _queued_failure(self) -> str | None:
        """The first ProcessFailed among the messages already sent, as wait_ready words it, or None."""
        while True:
            try:
                msg = await asyncio.wait_for(self._from_scheduler.recv(), timeout=READY_POLL_S)
            except asyncio.TimeoutError:
                return None
            if isinstance(msg, ProcessFailed):
                return f"{msg.who} failed to start: {msg.error_message}"

    async def _recv_loop(self) -> None:
        while True:
            msg = await self._from_scheduler.recv()
            if isinstance(msg, TokenDeltas):
                await self._on_deltas(msg)
            elif isinstance(msg, SlotsChanged):
                if self._on_slots is not None:
                    self._on_slots(msg)
            elif isinstance(msg, ProcessFailed):
                self._on_failure(f"{msg.who}: {msg.error_message}")
            else:
                future = self._waiting.pop(msg.op_id, None)
                if future is None:
                    logger.warning("dropped a late %s for operation %d", type(msg).__name__, msg.op_id)
                elif not future.done():
                    future.set_result(msg)

    async def send(self, msg: Any) -> None:
        await self._to_scheduler.send(msg)

    def next_op_id(self) -> int:
        return next(self._op_ids)

    async def call(self, msg: Any, timeout_s: float, frames: Sequence[Any] = ()) -> Any:
        """Send a control message (it carries op_id; `frames`: raw buffers that travel with it) and await the reply
        with that id, for at most timeout_s."""
        if self._failure is not None:
            raise ServerError(f"server is unhealthy: {self._failure}", "unavailable")
        future = asyncio.get_running_loop().create_future()
        self._waiting[msg.op_id] = future
        try:
            await self._to_scheduler.send(msg, frames)
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise ServerError(
                f"the scheduler did not answer {type(msg).__name__} within {timeout_s:g} s", "timeout"
            ) from None
        finally:
            self._waiting.pop(msg.op_id, None)

    async def stats(self) -> SchedulerStats:
        return await self.call(SchedulerStatsReq(op_id=self.next_op_id()), STATS_TIMEOUT_S)

    def fail_pending(self, reason: str) -> None:
        """A process died: every caller waiting on a reply gets a 503 now."""
        self._failure = reason
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(ServerError(f"server is unhealthy: {reason}", "unavailable"))
        self._waiting.clear()

    async def close(self, send_shutdown: bool) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        if not send_shutdown:  # the scheduler is gone
            return
        try:
            await asyncio.wait_for(self._to_scheduler.send(Shutdown()), timeout=1.0)
        except Exception:  # noqa: BLE001 - best effort on the way down
            pass

    def close_sockets(self) -> None:
        self._to_scheduler.close()
        self._from_scheduler.close()
