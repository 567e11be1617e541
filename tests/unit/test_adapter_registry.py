"""The registry's load plans (names, paths, pins, in-place reloads), the state file, and operation-id matching."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from loraplex.frontend.adapters.registry import AdapterEntry, AdapterError, AdapterRegistry
from loraplex.frontend.adapters.state_file import AdapterStateFile
from loraplex.protocol.errors import STATUS_BY_KIND, ServerError, http_status
from loraplex.protocol.structs import AdapterToLoad, LoRAAdapterSpec

from tests.server_utils import make_test_endpoints


def spec(name: str, path: Path, pinned: bool | None = None) -> LoRAAdapterSpec:
    return LoRAAdapterSpec(lora_name=name, lora_path=str(path), pinned=pinned)


def commit(registry: AdapterRegistry, plan: AdapterToLoad) -> None:
    registry.add(AdapterEntry(name=plan.lora_name, path=plan.lora_path, lora_id=plan.lora_id, pinned=plan.pinned))


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Path:
    path = tmp_path / "adapter"
    path.mkdir()
    return path


def test_pins_are_decided_once_and_an_inplace_reload_keeps_or_moves_its_pin(adapter_dir: Path) -> None:
    registry = AdapterRegistry(max_pinned=1)
    [plan] = registry.plan_load([spec("p", adapter_dir, pinned=True)], replace=False)
    assert isinstance(plan, AdapterToLoad) and plan.pinned and plan.replaces is None
    commit(registry, plan)
    [refused] = registry.plan_load([spec("q", adapter_dir, pinned=True)], replace=False)
    assert isinstance(refused, AdapterError) and refused.kind == "pinned_limit" and "'q'" in str(refused)
    # In place, at the limit: no `pinned` keeps the pin; pinned=True works too; both move it from the old id.
    for pinned in (None, True):
        [again] = registry.plan_load([spec("p", adapter_dir, pinned=pinned)], replace=True)
        assert isinstance(again, AdapterToLoad) and again.pinned and again.replaces == plan.lora_id
        assert again.lora_id != plan.lora_id
    [unpinned] = registry.plan_load([spec("p", adapter_dir, pinned=False)], replace=True)
    assert not unpinned.pinned


def test_eviction_spares_holders_keep_and_wanted_and_a_reload_counts_as_a_use(adapter_dir: Path) -> None:
    registry = AdapterRegistry()
    entries = {}
    for t, name in enumerate("abcd"):  # last used in this order
        entries[name] = AdapterEntry(name=name, path=str(adapter_dir), lora_id=registry.mint_id(), last_used=t)
        registry.add(entries[name])

    def victims(keep: set[str] = frozenset(), max_resident: int = 3) -> list[str]:
        return [e.name for e in registry.eviction_candidates(max_resident, set(keep))]

    assert victims() == ["a"] and victims(max_resident=2) == ["a", "b"]
    assert victims(keep={"a"}) == ["b"]
    registry.acquire("b", "rid-1")
    assert victims(keep={"a"}) == ["c"]  # held: never
    registry.release(entries["b"].lora_id, "rid-1")
    registry.want(["a", "b"])  # a batch being admitted needs a and b: they go only when nothing else can
    assert victims(max_resident=2) == ["c", "d"] and victims(max_resident=1) == ["c", "d", "a"]
    registry.unwant(["a", "b"])
    assert victims() == ["a"]
    # An evicted copy brought back is the most recently used one, not the next to go.
    entries["a"].resident = False
    registry.rebind(entries["a"], registry.mint_id())
    assert victims(max_resident=0) == ["c", "d", "b", "a"]  # b: used by rid-1 above


def test_one_load_is_checked_item_by_item(adapter_dir: Path, tmp_path: Path) -> None:
    registry = AdapterRegistry(path_root=str(tmp_path), max_pinned=1)
    plans = registry.plan_load(
        [
            spec("a", adapter_dir, pinned=True),
            spec("a", adapter_dir),
            spec("b", tmp_path / "missing"),
            spec("c", "/etc"),
            spec("bad:name", adapter_dir),
            spec("d", adapter_dir, pinned=True),
        ],
        replace=False,
    )
    kinds = [p.kind if isinstance(p, AdapterError) else "ok" for p in plans]
    assert kinds == ["ok", "duplicate", "not_found", "forbidden", "invalid", "pinned_limit"]
    assert [http_status(k, openai=True) for k in kinds[1:]] == [400, 404, 400, 400, 400]
    assert [http_status(k, openai=False) for k in kinds[1:]] == [400, 400, 400, 400, 400]
    [dup] = registry.plan_load([spec("a", adapter_dir)], replace=False)
    assert isinstance(dup, AdapterToLoad)  # nothing was committed
    commit(registry, dup)
    [dup] = registry.plan_load([spec("a", adapter_dir)], replace=False)
    assert "has already been loaded" in str(dup)
    [missing] = registry.plan_load([spec("zz", adapter_dir)], replace=True)
    assert missing.kind == "not_found"
    [nul] = registry.plan_load([LoRAAdapterSpec(lora_name="n", lora_path="a\x00b")], replace=False)
    assert nul.kind == "invalid" and "NUL" in str(nul)


def test_the_resolver_root_narrows_the_path_root(tmp_path: Path) -> None:
    resolver = tmp_path / "resolver"
    (resolver / "x").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    registry = AdapterRegistry()
    [ok] = registry.plan_load([spec("x", resolver / "x")], replace=False, root=str(resolver))
    assert isinstance(ok, AdapterToLoad) and ok.root == str(resolver)
    [outside] = registry.plan_load([spec("y", tmp_path / "elsewhere")], replace=False, root=str(resolver))
    assert outside.kind == "forbidden" and "--lora-resolver-dir" in str(outside)


def test_error_table_matches_the_contract() -> None:
    expected = {"invalid": (400, 400), "duplicate": (400, 400), "not_found": (400, 404), "unauthorized": (401, 401),
                "disabled": (403, 403), "busy": (409, 409), "timeout": (503, 503), "unavailable": (503, 503),
                "unsupported": (501, 501), "internal": (500, 500)}
    for kind, statuses in expected.items():
        assert STATUS_BY_KIND[kind] == statuses
    assert http_status("no such kind", openai=False) == 500
    with pytest.raises(AssertionError):
        ServerError("x", "no such kind")


def test_state_file_round_trip_is_atomic_and_tolerates_broken_files(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    state = AdapterStateFile(str(path))
    assert state.read() == []
    state.write([spec("a", tmp_path / "a", pinned=True), spec("b", tmp_path / "b")])
    assert [(s.lora_name, s.pinned) for s in state.read()] == [("a", True), ("b", False)]
    assert json.loads(path.read_text())["version"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temporary left behind
    for broken in ("{not json", json.dumps({"version": 99, "adapters": []}), json.dumps({"version": 1})):
        path.write_text(broken)
        assert state.read() == []
    blocked = tmp_path / "blocked"
    (blocked / "inside").mkdir(parents=True)  # a rename cannot replace a directory: the rewrite fails cleanly
    with pytest.raises(OSError):
        AdapterStateFile(str(blocked)).write([spec("c", tmp_path / "c")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocked", "state.json"]


def test_scheduler_client_matches_replies_by_operation_id(tmp_path: Path) -> None:
    from loraplex.frontend.cluster.scheduler_client import SchedulerClient
    from loraplex.protocol.sockets import PULL, PUSH, AsyncTypedSocket
    from loraplex.protocol.structs import AdapterOpDone, AdapterOutcome, DropAdapters, FrontendToScheduler

    async def scenario() -> None:
        endpoints = make_test_endpoints(tmp_path)
        client = SchedulerClient(endpoints, on_deltas=lambda msg: None, on_failure=lambda reason: None)
        inbox = AsyncTypedSocket(PULL, endpoints.frontend_to_scheduler, bind=True, recv_type=FrontendToScheduler)
        outbox = AsyncTypedSocket(PUSH, endpoints.scheduler_to_frontend, bind=False)
        client._recv_task = asyncio.create_task(client._recv_loop())

        def done(op_id: int) -> AdapterOpDone:
            return AdapterOpDone(op_id=op_id, outcomes=[AdapterOutcome(lora_id=op_id, success=True)])

        async def fake_scheduler() -> None:  # answers two operations in reverse order, after a stray late reply
            ops = [await inbox.recv(), await inbox.recv()]
            await outbox.send(done(999))
            for op in reversed(ops):
                await outbox.send(done(op.op_id))

        server = asyncio.create_task(fake_scheduler())
        ops = [DropAdapters(op_id=client.next_op_id(), lora_ids=[i]) for i in range(2)]
        replies = await asyncio.gather(*[client.call(op, 5) for op in ops])
        await server
        assert [r.op_id for r in replies] == [op.op_id for op in ops]
        assert [r.outcomes[0].lora_id for r in replies] == [op.op_id for op in ops]

        with pytest.raises(ServerError) as timed_out:
            await client.call(DropAdapters(op_id=client.next_op_id(), lora_ids=[]), 0.1)
        assert timed_out.value.kind == "timeout"
        await inbox.recv()
        pending = asyncio.create_task(client.call(DropAdapters(op_id=client.next_op_id(), lora_ids=[]), 5))
        await inbox.recv()
        client.fail_pending("worker1 exited")
        with pytest.raises(ServerError) as failed:
            await pending
        assert failed.value.kind == "unavailable" and "worker1" in str(failed.value)
        with pytest.raises(ServerError):  # and every later call at once
            await client.call(DropAdapters(op_id=client.next_op_id(), lora_ids=[]), 5)
        await client.close(send_shutdown=False)
        client.close_sockets()
        inbox.close()
        outbox.close()

    asyncio.run(scenario())
