"""`python -m scheduler` as a process: the test plays the frontend and a tp=1 worker over real sockets."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from protocol.config import ServerConfig
from protocol.proc import ARGS_ENV, encode_process_args
from protocol.sockets import PULL, PUSH, TypedSocket
from protocol.structs import (
    AbortReq,
    BatchResult,
    Endpoints,
    ForwardBatch,
    LoadLoRAAdapterReqInput,
    LoadLoRAAdapterReqOutput,
    LoRAAdapterResult,
    LoRAAdapterSpec,
    ProcessArgs,
    ProcessFailed,
    SamplingParams,
    SchedulerReady,
    SchedulerStats,
    SchedulerStatsReq,
    SchedulerToFrontend,
    SchedulerToWorker,
    Shutdown,
    TokenDelta,
    TokenDeltas,
    TokenizedGenerateReq,
    WorkerAdapterReport,
    WorkerReady,
)

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_MS = 10_000


class Harness:
    def __init__(self, tmp: Path):
        endpoints = Endpoints(
            frontend_to_scheduler=f"ipc://{tmp}/f2s",
            scheduler_to_frontend=f"ipc://{tmp}/s2f",
            scheduler_to_workers=[f"ipc://{tmp}/s2w0"],
            workers_to_scheduler=f"ipc://{tmp}/w2s",
            dist_init_addr="127.0.0.1:0",
        )
        self.frontend_in = TypedSocket(PULL, endpoints.scheduler_to_frontend, bind=True, recv_type=SchedulerToFrontend)
        self.worker_in = TypedSocket(PULL, endpoints.scheduler_to_workers[0], bind=True, recv_type=SchedulerToWorker)
        self.frontend_out = TypedSocket(PUSH, endpoints.frontend_to_scheduler, bind=False)
        self.worker_out = TypedSocket(PUSH, endpoints.workers_to_scheduler, bind=False)
        config = ServerConfig(page_size=4, max_loras_per_batch=2, log_level="debug")
        args = ProcessArgs(config=config, endpoints=endpoints, model_dir="/nonexistent")
        env = {**os.environ, ARGS_ENV: encode_process_args(args), "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-m", "scheduler"], cwd=REPO, env=env)

    def to_frontend(self, kind):
        msg = self.frontend_in.recv(TIMEOUT_MS)
        assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg!r}"
        return msg

    def to_worker(self, kind):
        msg = self.worker_in.recv(TIMEOUT_MS)
        assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg!r}"
        return msg

    def wait_exit(self) -> int:
        return self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for sock in (self.frontend_in, self.worker_in, self.frontend_out, self.worker_out):
            sock.close()


@pytest.fixture
def harness(tmp_path):
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        h.close()


def test_scheduler_process_serves_a_request_and_shuts_down(harness):
    harness.worker_out.send(WorkerReady(rank=0, max_total_tokens=100, context_length=64, vocab_size=32))
    ready = harness.to_frontend(SchedulerReady)
    assert (ready.max_total_tokens, ready.context_length, ready.vocab_size) == (100, 64, 32)

    # An adapter load goes to the rank and comes back merged.
    spec = LoRAAdapterSpec(lora_name="a", lora_path="/adapters/a", lora_id=0)
    harness.frontend_out.send(LoadLoRAAdapterReqInput(adapters=[spec]))
    assert harness.to_worker(LoadLoRAAdapterReqInput).adapters == [spec]
    harness.worker_out.send(
        WorkerAdapterReport(rank=0, results=[LoRAAdapterResult(lora_name="a", success=True, lora_id=0, rank=8)])
    )
    assert harness.to_frontend(LoadLoRAAdapterReqOutput).success

    sampling = SamplingParams(max_new_tokens=3)
    harness.frontend_out.send(TokenizedGenerateReq(rid="r", input_ids=[1, 2, 3], sampling=sampling, lora_id=0))
    tokens, finish = [], None
    while finish is None:
        batch = harness.to_worker(ForwardBatch)
        assert len(batch.reqs) == 1 and batch.reqs[0].slot == 0
        harness.worker_out.send(BatchResult(batch_id=batch.batch_id, next_token_ids=[11 + len(tokens)]))
        for delta in harness.to_frontend(TokenDeltas).deltas:
            assert delta.rid == "r"
            tokens += delta.token_ids
            finish = delta.finish_reason
    assert tokens == [11, 12, 13] and finish == "length"

    harness.frontend_out.send(SchedulerStatsReq())
    stats = harness.to_frontend(SchedulerStats)
    assert stats.num_running == 0 and stats.kv_usage == 0 and stats.slot_lora_ids == [0, -1]

    harness.frontend_out.send(Shutdown())
    harness.to_worker(Shutdown)
    assert harness.wait_exit() == 0


def test_scheduler_process_forwards_a_worker_failure_and_exits(harness):
    harness.worker_out.send(ProcessFailed(who="worker 0", error_message="model not found"))
    failed = harness.to_frontend(ProcessFailed)
    assert failed.who == "worker 0" and failed.error_message == "model not found"
    assert harness.wait_exit() != 0


def test_abort_is_read_while_a_pass_runs(harness):
    harness.worker_out.send(WorkerReady(rank=0, max_total_tokens=100, context_length=64, vocab_size=32))
    harness.to_frontend(SchedulerReady)
    sampling = SamplingParams(max_new_tokens=50)
    harness.frontend_out.send(TokenizedGenerateReq(rid="r", input_ids=[1, 2, 3], sampling=sampling))
    batch = harness.to_worker(ForwardBatch)
    harness.frontend_out.send(AbortReq(rid="r"))
    time.sleep(0.2)  # the worker is "slow": the abort arrives mid-pass
    harness.worker_out.send(BatchResult(batch_id=batch.batch_id, next_token_ids=[5]))
    assert harness.to_frontend(TokenDeltas).deltas == [TokenDelta(rid="r", token_ids=[], finish_reason="abort")]
    harness.frontend_out.send(SchedulerStatsReq())
    assert harness.to_frontend(SchedulerStats).kv_usage == 0
    assert harness.worker_in.recv(200) is None  # no further batch
    harness.frontend_out.send(Shutdown())
    assert harness.wait_exit() == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_idle_scheduler_sleeps(harness):
    harness.worker_out.send(WorkerReady(rank=0, max_total_tokens=100, context_length=64, vocab_size=32))
    harness.to_frontend(SchedulerReady)

    def cpu_seconds() -> float:
        fields = Path(f"/proc/{harness.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    before = cpu_seconds()
    time.sleep(1.0)
    assert cpu_seconds() - before < 0.2


def test_the_scheduler_never_imports_torch():
    code = "import sys, scheduler.process, scheduler.__main__; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0
