"""`python -m worker` as the scheduler sees it: ready, forward, errors as values, adapters refused, shutdown."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from worker_helpers import GREEDY, FakeScheduler, make_runner

from protocol.config import ServerConfig
from protocol.proc import ARGS_ENV, encode_process_args
from protocol.structs import (
    BatchResult,
    DropAdapters,
    Endpoints,
    ForwardBatch,
    ForwardReq,
    LoadLoRAAdapterReqInput,
    LoRAAdapterSpec,
    ProcessArgs,
    ProcessFailed,
    SamplingParams,
    Shutdown,
    WorkerAdapterReport,
    WorkerReady,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_MS = 60_000
EXIT_TIMEOUT_S = 20


@contextmanager
def start_worker(model_dir: str, **config_kwargs) -> Iterator[tuple[subprocess.Popen, FakeScheduler]]:
    # A short private directory: ipc:// paths are limited to ~100 characters.
    with tempfile.TemporaryDirectory(prefix="lpw") as sock_dir:
        endpoints = Endpoints(
            frontend_to_scheduler=f"ipc://{sock_dir}/f2s",
            scheduler_to_frontend=f"ipc://{sock_dir}/s2f",
            scheduler_to_workers=[f"ipc://{sock_dir}/s2w0"],
            workers_to_scheduler=f"ipc://{sock_dir}/w2s",
            dist_init_addr="127.0.0.1:1",  # unused at tp=1
        )
        config = ServerConfig(device="cpu", page_size=4, max_total_tokens=256, log_level="debug", **config_kwargs)
        args = ProcessArgs(config=config, endpoints=endpoints, model_dir=model_dir)
        scheduler = FakeScheduler(endpoints)
        env = {**os.environ, ARGS_ENV: encode_process_args(args), "PYTHONPATH": str(REPO_ROOT)}
        proc = subprocess.Popen([sys.executable, "-m", "worker"], cwd=REPO_ROOT, env=env)
        try:
            yield proc, scheduler
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            scheduler.close()


def test_worker_serves_batches_and_shuts_down(llama_dir: Path) -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    runner = make_runner(llama_dir)
    expected = runner.prefill_logits(prompt)[-1].argmax().item()
    with start_worker(str(llama_dir)) as (proc, scheduler):
        ready = scheduler.recv(timeout_ms=READY_TIMEOUT_MS)
        assert isinstance(ready, WorkerReady), ready
        assert (ready.rank, ready.max_total_tokens, ready.context_length) == (0, 256, 2048)
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

        spec = LoRAAdapterSpec(lora_name="a", lora_path="/nowhere", lora_id=3)
        scheduler.send(LoadLoRAAdapterReqInput(adapters=[spec]))
        report = scheduler.recv()
        assert isinstance(report, WorkerAdapterReport) and report.rank == 0
        assert [(r.lora_name, r.success, r.error_message, r.lora_id) for r in report.results] == [
            ("a", False, "LoRA not enabled", 3)
        ]
        scheduler.send(DropAdapters(lora_ids=[3]))  # no reply expected

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
