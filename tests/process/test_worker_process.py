"""`python -m loraplex.worker` as the scheduler sees it: ready, forward, errors as values, adapters refused, shutdown;
and exits on any other error (an injected fault, a collective past --dist-timeout)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from loraplex.protocol import cpu_cores
from loraplex.protocol.structs import (
    AdapterOutcome,
    AdapterReport,
    AdapterToLoad,
    BatchResult,
    DropAdapters,
    ForwardBatch,
    ForwardReq,
    LoadAdapters,
    ProcessFailed,
    SamplingParams,
    Shutdown,
    WorkerReady,
)

import tests.worker_procs as worker_procs
from tests.worker_helpers import GREEDY, FakeScheduler, make_runner, prefill_logits

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_MS = 60_000
EXIT_TIMEOUT_S = 20


@contextmanager
def start_workers(
    model_dir: str, tp: int = 1, faults: dict[str, object] | None = None, **config_kwargs
) -> Iterator[tuple[list[subprocess.Popen], FakeScheduler]]:
    with worker_procs.start_workers(model_dir, tp, faults, log_level="debug", **config_kwargs) as started:
        yield started


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_worker_pins_its_threads_and_names_the_cores_it_leaves(llama_dir: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    bind = {cpu_cores.BIND_ENV: str(cores[-1])}  # vLLM's setting: the last core to the worker
    with worker_procs.start_workers(str(llama_dir), extra_env=bind) as (procs, scheduler):
        ready = scheduler.recv(timeout_ms=READY_TIMEOUT_MS)
        assert isinstance(ready, WorkerReady), ready
        assert os.sched_getaffinity(procs[0].pid) == {cores[-1]}
        assert ready.service_cpu_cores == cores[:-1]  # where the scheduler and the frontend keep to
        scheduler.send(Shutdown())
        assert procs[0].wait(timeout=EXIT_TIMEOUT_S) == 0


@contextmanager
def start_worker(model_dir: str, **config_kwargs) -> Iterator[tuple[subprocess.Popen, FakeScheduler]]:
    with start_workers(model_dir, **config_kwargs) as (procs, scheduler):
        yield procs[0], scheduler


def test_worker_serves_batches_and_shuts_down(llama_dir: Path) -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    runner = make_runner(llama_dir)
    expected = prefill_logits(runner, prompt)[-1].argmax().item()
    with start_worker(str(llama_dir)) as (proc, scheduler):
        ready = scheduler.recv(timeout_ms=READY_TIMEOUT_MS)
        assert isinstance(ready, WorkerReady), ready
        assert (ready.tp_rank, ready.max_total_tokens, ready.context_length) == (0, 256, 2048)
        assert ready.vocab_size == runner.vocab_size

        req = ForwardReq(input_ids=prompt, num_cached_tokens=0, page_ids=[9, 2], sampling=GREEDY)
        scheduler.send(ForwardBatch(batch_id=1, reqs=[req]))
        assert scheduler.recv() == BatchResult(batch_id=1, next_token_ids=[expected])

        # A bad batch is answered with an error, and the worker keeps serving.
        bad = ForwardReq(input_ids=prompt, num_cached_tokens=0, page_ids=[9999, 2], sampling=GREEDY)
        scheduler.send(ForwardBatch(batch_id=2, reqs=[bad]))
        reply = scheduler.recv()
        assert isinstance(reply, BatchResult) and reply.batch_id == 2 and reply.next_token_ids == []
        assert "outside" in reply.error_message

        # Without LoRA, a load is refused (on the loader socket) and a drop is a no-op.
        scheduler.load(LoadAdapters(op_id=4, adapters=[AdapterToLoad(lora_id=3, lora_name="a", lora_path="/nowhere")]))
        report = scheduler.recv()
        assert isinstance(report, AdapterReport) and (report.op_id, report.tp_rank) == (4, 0)
        assert report.outcomes == [
            AdapterOutcome(lora_id=3, success=False, error_message="LoRA is not enabled", error_kind="invalid")
        ]
        scheduler.send(DropAdapters(op_id=5, lora_ids=[3]))  # no reply expected

        sampled = ForwardReq(
            input_ids=prompt, num_cached_tokens=0, page_ids=[0, 1], sampling=SamplingParams(seed=1), num_generated=0
        )
        scheduler.send(ForwardBatch(batch_id=3, reqs=[sampled, req]))
        reply = scheduler.recv()
        assert reply.batch_id == 3 and len(reply.next_token_ids) == 2 and reply.next_token_ids[1] == expected

        scheduler.send(Shutdown())
        assert proc.wait(timeout=EXIT_TIMEOUT_S) == 0


@pytest.mark.parametrize("problem", ["missing_model", "context_too_long"])
def test_worker_reports_start_up_failure(llama_dir: Path, tmp_path: Path, problem: str) -> None:
    model_dir, kwargs = {
        "missing_model": (str(tmp_path / "missing"), {}),
        "context_too_long": (str(llama_dir), {"context_length": 10**6}),
    }[problem]
    with start_worker(model_dir, **kwargs) as (proc, scheduler):
        failed = scheduler.recv(timeout_ms=READY_TIMEOUT_MS)
        assert isinstance(failed, ProcessFailed), failed
        assert failed.who == "worker0"
        assert {"missing_model": "does not exist", "context_too_long": "exceeds"}[problem] in failed.error_message
        assert proc.wait(timeout=EXIT_TIMEOUT_S) != 0


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def one_batch(batch_id: int) -> ForwardBatch:
    return ForwardBatch(batch_id=batch_id, reqs=[ForwardReq(input_ids=PROMPT, num_cached_tokens=0, page_ids=[0, 1],
                                                            sampling=GREEDY)])


def test_worker_exits_on_an_error_that_is_not_the_batchs(llama_dir: Path) -> None:
    with start_workers(str(llama_dir), faults={"crash_forward_on_rank": 0}) as ([proc], scheduler):
        assert isinstance(scheduler.recv(timeout_ms=READY_TIMEOUT_MS), WorkerReady)
        scheduler.send(one_batch(1))
        failed = scheduler.recv()
        assert isinstance(failed, ProcessFailed), failed
        assert failed.who == "worker0" and "RuntimeError: injected fault on rank 0" in failed.error_message
        assert proc.wait(timeout=EXIT_TIMEOUT_S) == 1


def test_collective_past_dist_timeout_exits_the_waiting_rank(llama_dir: Path) -> None:
    # Rank 1 sleeps far longer than --dist-timeout before its forward pass; rank 0 waits in the first all-reduce.
    faults = {"stall_forward_on_rank": 1, "stall_forward_s": 120.0}
    with start_workers(str(llama_dir), tp=2, faults=faults, dist_timeout=2.0) as (procs, scheduler):
        ready = [scheduler.recv(timeout_ms=READY_TIMEOUT_MS) for _ in range(2)]
        assert all(isinstance(r, WorkerReady) for r in ready), ready
        started = time.monotonic()
        scheduler.send(one_batch(1))
        failed = scheduler.recv(timeout_ms=30_000)
        assert isinstance(failed, ProcessFailed) and failed.who == "worker0", failed
        assert "Timed out" in failed.error_message, failed.error_message
        assert procs[0].wait(timeout=EXIT_TIMEOUT_S) == 1
        # Not before the timeout (so it is the timeout that fired), and well before start-up's 10 minutes.
        assert 2.0 <= time.monotonic() - started < 20
        assert procs[1].poll() is None  # still asleep: nobody but the timeout ended rank 0
