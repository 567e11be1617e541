"""`python -m loraplex.worker` with LoRA, as the scheduler sees it: loads on the loader sockets, off the decode loop,
each report naming its operation; faults (fail, hang); drops, and batches naming a dropped adapter failing as values."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loraplex.protocol.adapters.lora_targets import TARGET_MODULES
from loraplex.protocol.structs import (
    AdapterReport,
    AdapterToLoad,
    BatchResult,
    DropAdapters,
    ForwardBatch,
    ForwardReq,
    LoadAdapters,
    Shutdown,
    SlotLoad,
    WorkerReady,
)

import tests.worker_procs as worker_procs
from tests.lora_helpers import LORA_CONFIG
from tests.worker_helpers import GREEDY, FakeScheduler, make_runner, prefill_logits

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_MS = 90_000
EXIT_TIMEOUT_S = 20
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@contextmanager
def start_workers(model_dir: Path, tp: int, faults: dict[str, object]) -> Iterator[tuple[list, FakeScheduler]]:
    with worker_procs.start_workers(model_dir, tp, faults, **LORA_CONFIG) as started:
        yield started


def req(slot: int = -1, first_page: int = 0) -> ForwardReq:
    page_ids = [first_page, first_page + 1]
    return ForwardReq(input_ids=PROMPT, num_cached_tokens=0, page_ids=page_ids, sampling=GREEDY, slot=slot)


def spec(name: str, path: Path | str, lora_id: int) -> AdapterToLoad:
    return AdapterToLoad(lora_name=name, lora_path=str(path), lora_id=lora_id)


def recv_reports(scheduler: FakeScheduler, count: int) -> dict[tuple[int, int], AdapterReport]:
    """The next `count` messages, all adapter reports, by (op_id, tp_rank): they may come in any order."""
    reports = {}
    for _ in range(count):
        report = scheduler.recv()
        assert isinstance(report, AdapterReport), report
        reports[report.op_id, report.tp_rank] = report
    assert len(reports) == count
    return reports


def test_loads_run_off_the_decode_loop(llama_dir: Path, adapter_dirs: dict[str, Path], tmp_path: Path) -> None:
    # The tokens the worker must produce, from an in-process runner: base, a8 (slot 0), a16 (slot 1).
    runner = make_runner(llama_dir, **LORA_CONFIG)
    runner.lora.load([spec("a8", adapter_dirs["a8"], 2), spec("a16", adapter_dirs["a16"], 3)])
    runner.forward(
        ForwardBatch(batch_id=0, reqs=[], slot_loads=[SlotLoad(slot=0, lora_id=2), SlotLoad(slot=1, lora_id=3)])
    )
    expected = [prefill_logits(runner, PROMPT, slot)[-1].argmax().item() for slot in (-1, 0, 1)]
    assert len(set(expected)) > 1, "the adapters should change the next token"

    with start_workers(llama_dir, tp=1, faults={"load_delay_s": 1.0}) as (proc, scheduler):
        ready = scheduler.recv(timeout_ms=READY_TIMEOUT_MS)
        assert isinstance(ready, WorkerReady), ready
        assert (ready.max_lora_rank, ready.lora_target_modules) == (64, list(TARGET_MODULES))

        missing = tmp_path / "missing"
        scheduler.load(LoadAdapters(op_id=21, adapters=[spec("a8", adapter_dirs["a8"], 2), spec("m", missing, 9)]))
        scheduler.load(LoadAdapters(op_id=22, adapters=[spec("a16", adapter_dirs["a16"], 3)]))
        scheduler.send(ForwardBatch(batch_id=1, reqs=[req()]))
        # Each load sleeps 1 s on its own thread; a loop blocked by them would answer the batch last.
        assert scheduler.recv() == BatchResult(batch_id=1, next_token_ids=[expected[0]])

        reports = recv_reports(scheduler, 2)  # each names its operation: the order they come in does not matter
        first, second = reports[21, 0].outcomes, reports[22, 0].outcomes
        assert [(o.lora_id, o.success, o.lora_rank) for o in first + second] == [
            (2, True, 8), (9, False, 0), (3, True, 16)]
        assert first[0].target_modules == ["gate_proj", "up_proj", "down_proj"]
        assert first[1].error_kind == "not_found" and "does not exist" in first[1].error_message

        loads = [SlotLoad(slot=0, lora_id=2), SlotLoad(slot=1, lora_id=3)]
        scheduler.send(ForwardBatch(batch_id=2, reqs=[req(), req(0, 2), req(1, 4)], slot_loads=loads))
        assert scheduler.recv() == BatchResult(batch_id=2, next_token_ids=expected)

        scheduler.send(DropAdapters(op_id=23, lora_ids=[2]))  # also empties slot 0
        scheduler.send(ForwardBatch(batch_id=3, reqs=[req(0)]))
        reply = scheduler.recv()
        assert reply.batch_id == 3 and reply.next_token_ids == [] and "holds no adapter" in reply.error_message
        scheduler.send(ForwardBatch(batch_id=4, reqs=[req(0)], slot_loads=[SlotLoad(slot=0, lora_id=2)]))
        reply = scheduler.recv()
        assert reply.batch_id == 4 and reply.next_token_ids == [] and "adapter id 2" in reply.error_message
        scheduler.send(ForwardBatch(batch_id=5, reqs=[req(1), req(-1, 2)]))  # still serving the others
        assert scheduler.recv() == BatchResult(batch_id=5, next_token_ids=[expected[2], expected[0]])

        scheduler.send(Shutdown())
        assert proc[0].wait(timeout=EXIT_TIMEOUT_S) == 0


def test_injected_fault_fails_one_rank(llama_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    runner = make_runner(llama_dir, **LORA_CONFIG)  # tp=1: the token a8 must give at tp=2
    runner.lora.load([spec("fine", adapter_dirs["a8"], 2)])
    runner.forward(ForwardBatch(batch_id=0, reqs=[], slot_loads=[SlotLoad(slot=1, lora_id=2)]))
    expected = prefill_logits(runner, PROMPT, 1)[-1].argmax().item()

    faults = {"fail_load_on_rank": 1, "fail_load_name": "faulty"}
    with start_workers(llama_dir, tp=2, faults=faults) as (procs, scheduler):
        readies = [scheduler.recv(timeout_ms=READY_TIMEOUT_MS) for _ in procs]
        assert sorted(r.tp_rank for r in readies if isinstance(r, WorkerReady)) == [0, 1], readies

        adapters = [spec("faulty", adapter_dirs["a4"], 1), spec("fine", adapter_dirs["a8"], 2)]
        scheduler.load(LoadAdapters(op_id=7, adapters=adapters))
        reports = recv_reports(scheduler, 2)
        assert [(o.lora_id, o.success, o.lora_rank) for o in reports[7, 0].outcomes] == [(1, True, 4), (2, True, 8)]
        assert [(o.lora_id, o.success, o.error_message) for o in reports[7, 1].outcomes] == [
            (1, False, "injected fault on rank 1"),
            (2, True, ""),
        ]
        assert reports[7, 1].outcomes[0].error_kind == "internal"

        # As the scheduler does for a partial load: every rank drops it. A batch naming it then fails on every rank
        # before any collective, and both ranks keep serving, adapters included.
        scheduler.send(DropAdapters(op_id=8, lora_ids=[1]))
        scheduler.send(ForwardBatch(batch_id=1, reqs=[req(0)], slot_loads=[SlotLoad(slot=0, lora_id=1)]))
        reply = scheduler.recv()
        assert reply.batch_id == 1 and "adapter id 1" in reply.error_message and "not loaded" in reply.error_message
        scheduler.send(ForwardBatch(batch_id=2, reqs=[req(1)], slot_loads=[SlotLoad(slot=1, lora_id=2)]))
        assert scheduler.recv() == BatchResult(batch_id=2, next_token_ids=[expected])

        scheduler.send(Shutdown())
        assert [proc.wait(timeout=EXIT_TIMEOUT_S) for proc in procs] == [0, 0]


def test_a_hung_load_delays_only_itself(llama_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    # The read of "stuck" never returns (a stuck network file system): later loads and batches go on, the rollback
    # of the stuck id is taken at once, and Shutdown is not held up by the hung thread.
    faults = {"hang_load_on_rank": 0, "fail_load_name": "stuck"}
    with start_workers(llama_dir, tp=1, faults=faults) as ([proc], scheduler):
        assert isinstance(scheduler.recv(timeout_ms=READY_TIMEOUT_MS), WorkerReady)
        scheduler.load(LoadAdapters(op_id=1, adapters=[spec("stuck", adapter_dirs["a4"], 1)]))
        scheduler.load(LoadAdapters(op_id=2, adapters=[spec("fine", adapter_dirs["a8"], 2)]))
        report = scheduler.recv()
        assert isinstance(report, AdapterReport) and report.op_id == 2, report
        assert [(o.lora_id, o.success) for o in report.outcomes] == [(2, True)]
        scheduler.send(DropAdapters(op_id=3, lora_ids=[1]))  # the scheduler's rollback at the deadline
        scheduler.send(ForwardBatch(batch_id=1, reqs=[req(0)], slot_loads=[SlotLoad(slot=0, lora_id=2)]))
        reply = scheduler.recv()
        assert isinstance(reply, BatchResult) and reply.batch_id == 1 and len(reply.next_token_ids) == 1, reply
        scheduler.send(ForwardBatch(batch_id=2, reqs=[req(1)], slot_loads=[SlotLoad(slot=1, lora_id=1)]))
        reply = scheduler.recv()
        assert reply.batch_id == 2 and "adapter id 1" in reply.error_message and "not loaded" in reply.error_message
        scheduler.send(Shutdown())
        assert proc.wait(timeout=EXIT_TIMEOUT_S) == 0
        assert scheduler.from_workers.recv(timeout_ms=200) is None  # the hung op never reports
