"""RequestTable: the requests in flight, by rid — the only place one enters (routed, counted) and leaves (its holds
released, its output charged, the scheduler told), and where the schedulers' token deltas land.

The GenerateService owns it; the Runtime reaches it only to drain and to fail everything (frontend/runtime.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from loraplex.frontend.request_state import RequestState
from loraplex.protocol.structs import AbortReq, AbortReqOutput, TokenDeltas


class RequestTable:
    def __init__(self, runtime: Any):
        self.runtime = runtime  # its pieces (router, metrics, rate limits, adapters, replicas); they outlive requests
        self._states: dict[str, RequestState] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._states

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(list(self._states.values()))

    def get(self, rid: str) -> RequestState | None:
        return self._states.get(rid)

    def add(self, state: RequestState) -> None:
        """A request whose adapter (if any) is held: routed to a replica, counted, in flight from now on."""
        runtime = self.runtime
        state.dp_rank = runtime.router.pick(state.lora_id)
        runtime.router.acquire(state.dp_rank, state.lora_id)
        self._states[state.rid] = state
        runtime.metrics.on_submit(len(state.prompt_ids))

    async def finish(self, states: list[RequestState]) -> None:
        """Every path of every request ends here (done, failed, client gone): frees what each state holds. A state
        already gone (a second finish) is skipped."""
        runtime = self.runtime
        for state in states:
            if self._states.pop(state.rid, None) is None:
                continue
            was_finished = state.finished
            if not was_finished:
                state.fail("aborted by the client", status=499)
            # Counted before the hold goes: once released, an unload may drop the adapter's series.
            runtime.metrics.on_finish(state)
            runtime.rate_limits.charge_output(state.key_id, len(state.output_ids))
            runtime.router.release(state.dp_rank, state.lora_id)
            if state.lora_id is not None:
                runtime.adapters.release(state.lora_id, state.rid)
            if not was_finished and runtime.failure is None and not runtime.stopping:
                await runtime.replicas.send(state.dp_rank, AbortReq(rid=state.rid))

    async def abort(self, rid: str) -> AbortReqOutput:
        state = self._states.get(rid)
        if state is None:
            return AbortReqOutput(success=False, rid=rid, message=f"no request {rid!r} in flight")
        await self.runtime.replicas.send(state.dp_rank, AbortReq(rid=rid))
        return AbortReqOutput(success=True, rid=rid, message="")

    async def abort_unfinished(self, message: str) -> int:
        """The end of a drain: every request still running ends with finish reason abort (its handler then calls
        finish). Returns how many."""
        left = [state for state in self._states.values() if not state.finished]
        for state in left:
            state.abort(message)
            if self.runtime.failure is None:
                await self.runtime.replicas.send(state.dp_rank, AbortReq(rid=state.rid))
        return len(left)

    def fail_all(self, message: str, status: int) -> None:
        for state in list(self._states.values()):
            state.fail(message, status)

    async def apply_deltas(self, msg: TokenDeltas) -> None:
        for delta in msg.deltas:
            state = self._states.get(delta.rid)
            if state is None:
                continue
            if state.apply(delta):  # a stop string ended it: free its scheduler resources
                await self.runtime.replicas.send(state.dp_rank, AbortReq(rid=state.rid))
