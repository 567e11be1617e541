"""Test-only fault injection into the workers, inert unless the environment asks for it.

A test sets FAULTS_ENV (JSON of a FaultPlan) in the environment of a server, an Engine or a worker it starts; child
processes inherit it, and each worker reads it once at start-up (an unknown field or a wrong type fails the start).
Nothing else reads it, so the plan never travels through the frontend or the scheduler.
"""

from __future__ import annotations

import os

import msgspec

FAULTS_ENV = "LORAPLEX_TEST_FAULTS"


class FaultPlan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Ranks are global ranks; None: no such fault.
    # The forward pass (worker/process.py):
    crash_forward_on_rank: int | None = None  # raises a RuntimeError (not a BatchError) in every forward pass
    stall_forward_on_rank: int | None = None  # sleeps stall_forward_s before every forward pass, so the other
    stall_forward_s: float = 0.0  # ranks wait in a collective (tests of --dist-timeout, slow steps)
    # Adapter loads (worker/adapter_loader.py):
    fail_load_on_rank: int | None = None  # every load fails with "injected fault on rank N"
    hang_load_on_rank: int | None = None  # never answers a load (until the worker stops)
    fail_load_name: str | None = None  # ... of the two above, only loads of adapters with this name
    fail_load_on_replica: int | None = None  # ... of the two above, only on this data-parallel replica
    load_delay_s: float = 0.0  # every load sleeps this long first (tests of loads off the decode loop)
    refuse_path_loads: bool = False  # every adapter sent as a path fails (a node's ranks must get tensors)


def read_fault_plan() -> FaultPlan:
    raw = os.environ.get(FAULTS_ENV)
    return msgspec.json.decode(raw, type=FaultPlan) if raw else FaultPlan()
