"""SamplingTable: each request's SamplingParams on this rank, kept by req_key between its passes.

The scheduler sends a request's parameters on its first pass after admission only (a grammar's whole text included),
and names the key in released_keys once the request ended; every rank keeps the same table, as every rank gets every
batch."""

from __future__ import annotations

from loraplex.protocol.structs import ForwardReq, SamplingParams
from loraplex.worker.batch_inputs import BatchError


class SamplingTable:
    def __init__(self) -> None:
        self._params: dict[int, SamplingParams] = {}  # req_key -> its parameters

    def __len__(self) -> int:
        return len(self._params)

    def __contains__(self, key: int) -> bool:
        return key in self._params

    def release(self, keys: list[int]) -> None:
        for key in keys:
            self._params.pop(key, None)

    def resolve(self, reqs: list[ForwardReq]) -> list[SamplingParams]:
        """Each request's parameters: those it carries (kept for its next passes), else the ones kept for its key."""
        # Kept before any row can fail: a rejected batch ends its requests, whose keys come back released.
        for req in reqs:
            if req.sampling is not None and req.req_key >= 0:
                self._params[req.req_key] = req.sampling
        params = []
        for i, req in enumerate(reqs):
            if req.sampling is not None:
                params.append(req.sampling)
            elif req.req_key < 0:
                raise BatchError(f"request {i} carries no sampling parameters and has no req_key")
            elif (kept := self._params.get(req.req_key)) is None:
                raise BatchError(f"request {i}: no sampling parameters sent or kept for req_key {req.req_key}")
            else:
                params.append(kept)
        return params
