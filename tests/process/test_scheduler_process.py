"""`python -m loraplex.scheduler` as a process: the test plays the frontend and a tp=1 worker over real sockets."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.proc import ARGS_ENV, encode_process_args
from loraplex.protocol.sockets import PULL, PUSH, TypedSocket
from loraplex.protocol.structs import (
    AbortReq,
    AdapterOpDone,
    AdapterOutcome,
    AdapterReport,
    AdapterToLoad,
    BatchResult,
    DropAdapters,
    ForwardBatch,
    LoadAdapters,
    ProcessArgs,
    ProcessFailed,
    SamplingParams,
    SchedulerReady,
    SchedulerStats,
    SchedulerStatsReq,
    SchedulerToFrontend,
    SchedulerToWorker,
    Shutdown,
    SlotsChanged,
    TokenDelta,
    TokenDeltas,
    TokenizedGenerateReq,
    WorkerReady,
)

from tests.server_utils import make_test_endpoints

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_MS = 10_000


class Harness:
    def __init__(self, tmp: Path, **config_kwargs):
        endpoints = make_test_endpoints(tmp)
        self.frontend_in = TypedSocket(PULL, endpoints.scheduler_to_frontend, bind=True, recv_type=SchedulerToFrontend)
        self.worker_in = TypedSocket(PULL, endpoints.scheduler_to_workers[0], bind=True, recv_type=SchedulerToWorker)
        self.loader_in = TypedSocket(PULL, endpoints.scheduler_to_loaders[0], bind=True, recv_type=LoadAdapters)
        self.frontend_out = TypedSocket(PUSH, endpoints.frontend_to_scheduler, bind=False)
        self.worker_out = TypedSocket(PUSH, endpoints.workers_to_scheduler, bind=False)
        config = ServerConfig(page_size=4, max_loras_per_batch=2, log_level="debug", **config_kwargs)
        args = ProcessArgs(config=config, endpoints=endpoints, model_dir="/nonexistent")
        env = {**os.environ, ARGS_ENV: encode_process_args(args), "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-m", "loraplex.scheduler"], cwd=REPO, env=env)
        self.slot_tables: list[list[int]] = []  # every SlotsChanged, in order

    def to_frontend(self, kind):
        """The next message to the frontend; slot tables, which may come between any two, are kept aside."""
        msg = self.frontend_in.recv(TIMEOUT_MS)
        while isinstance(msg, SlotsChanged):
            self.slot_tables.append(msg.slot_lora_ids)
            msg = self.frontend_in.recv(TIMEOUT_MS)
        assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg!r}"
        return msg

    def to_worker(self, kind):
        msg = self.worker_in.recv(TIMEOUT_MS)
        assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg!r}"
        return msg

    def to_loader(self) -> LoadAdapters:
        msg = self.loader_in.recv(TIMEOUT_MS)
        assert isinstance(msg, LoadAdapters), f"expected LoadAdapters, got {msg!r}"
        return msg

    def start(self) -> SchedulerReady:
        self.worker_out.send(WorkerReady(tp_rank=0, max_total_tokens=100, context_length=64, vocab_size=32))
        return self.to_frontend(SchedulerReady)

    def wait_exit(self) -> int:
        return self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for sock in (self.frontend_in, self.worker_in, self.loader_in, self.frontend_out, self.worker_out):
            sock.close()


@pytest.fixture
def harness(tmp_path):
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        h.close()


def test_scheduler_process_serves_a_request_and_shuts_down(harness):
    harness.worker_out.send(WorkerReady(tp_rank=0, max_total_tokens=100, context_length=64, vocab_size=32))
    ready = harness.to_frontend(SchedulerReady)
    assert (ready.max_total_tokens, ready.context_length, ready.vocab_size) == (100, 64, 32)

    # An adapter load goes to the rank's loader socket and comes back merged, under its op id.
    op = LoadAdapters(op_id=5, adapters=[AdapterToLoad(lora_id=0, lora_name="a", lora_path="/adapters/a")])
    harness.frontend_out.send(op)
    assert harness.to_loader() == op
    outcome = AdapterOutcome(lora_id=0, success=True, lora_rank=8, target_modules=["q_proj"])
    harness.worker_out.send(AdapterReport(op_id=5, tp_rank=0, outcomes=[outcome]))
    assert harness.to_frontend(AdapterOpDone) == AdapterOpDone(op_id=5, outcomes=[outcome])

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

    harness.frontend_out.send(SchedulerStatsReq(op_id=8))
    stats = harness.to_frontend(SchedulerStats)
    assert stats.op_id == 8
    assert stats.num_running == 0 and stats.kv_usage == 0 and stats.slot_lora_ids == [0, -1]

    # A drop reaches the workers' batch socket and is answered with its op id.
    harness.frontend_out.send(DropAdapters(op_id=9, lora_ids=[0]))
    assert harness.to_worker(DropAdapters) == DropAdapters(op_id=9, lora_ids=[0])
    dropped = AdapterOutcome(lora_id=0, success=True)
    assert harness.to_frontend(AdapterOpDone) == AdapterOpDone(op_id=9, outcomes=[dropped])
    assert harness.slot_tables == [[0, -1], [-1, -1]]  # the adapter took a slot, then the drop emptied it

    harness.frontend_out.send(Shutdown())
    harness.to_worker(Shutdown)
    assert harness.wait_exit() == 0


def test_scheduler_process_forwards_a_worker_failure_and_exits(harness):
    harness.worker_out.send(ProcessFailed(who="worker 0", error_message="model not found"))
    failed = harness.to_frontend(ProcessFailed)
    assert failed.who == "worker 0" and failed.error_message == "model not found"
    assert harness.wait_exit() != 0


def test_abort_is_read_while_a_pass_runs(harness):
    harness.worker_out.send(WorkerReady(tp_rank=0, max_total_tokens=100, context_length=64, vocab_size=32))
    harness.to_frontend(SchedulerReady)
    sampling = SamplingParams(max_new_tokens=50)
    harness.frontend_out.send(TokenizedGenerateReq(rid="r", input_ids=[1, 2, 3], sampling=sampling))
    batch = harness.to_worker(ForwardBatch)
    second = harness.to_worker(ForwardBatch)  # the next pass is sent before the first returns (overlap)
    assert second.reqs[0].prev_row == 0 and second.reqs[0].num_cached_tokens == 3
    harness.frontend_out.send(AbortReq(rid="r"))
    time.sleep(0.2)  # the worker is "slow": the abort arrives mid-pass
    harness.worker_out.send(BatchResult(batch_id=batch.batch_id, next_token_ids=[5]))
    harness.worker_out.send(BatchResult(batch_id=second.batch_id, next_token_ids=[6]))
    assert harness.to_frontend(TokenDeltas).deltas == [TokenDelta(rid="r", token_ids=[], finish_reason="abort")]
    harness.frontend_out.send(SchedulerStatsReq(op_id=1))
    assert harness.to_frontend(SchedulerStats).kv_usage == 0
    assert harness.worker_in.recv(200) is None  # no further batch
    harness.frontend_out.send(Shutdown())
    assert harness.wait_exit() == 0


def test_a_load_is_forwarded_and_answered_mid_pass(harness):
    harness.start()
    sampling = SamplingParams(max_new_tokens=5)
    harness.frontend_out.send(TokenizedGenerateReq(rid="r", input_ids=[1, 2], sampling=sampling))
    batch = harness.to_worker(ForwardBatch)
    # The pass is still running: the load reaches the loader at once all the same.
    op = LoadAdapters(op_id=3, adapters=[AdapterToLoad(lora_id=4, lora_name="b", lora_path="/adapters/b")])
    harness.frontend_out.send(op)
    assert harness.to_loader() == op
    failed = AdapterOutcome(lora_id=4, success=False, error_message="no adapter_config.json", error_kind="not_found")
    harness.worker_out.send(AdapterReport(op_id=3, tp_rank=0, outcomes=[failed]))
    assert harness.to_frontend(AdapterOpDone) == AdapterOpDone(op_id=3, outcomes=[failed])
    harness.worker_out.send(BatchResult(batch_id=batch.batch_id, next_token_ids=[5]))
    assert harness.to_frontend(TokenDeltas).deltas[0].token_ids == [5]
    harness.frontend_out.send(Shutdown())
    assert harness.wait_exit() == 0


def test_a_load_that_a_rank_never_answers_times_out_and_is_rolled_back(tmp_path):
    harness = Harness(tmp_path, lora_load_timeout=0.5)
    try:
        harness.start()
        op = LoadAdapters(op_id=2, adapters=[AdapterToLoad(lora_id=7, lora_name="slow", lora_path="/adapters/slow")])
        harness.frontend_out.send(op)
        assert harness.to_loader() == op
        done = harness.to_frontend(AdapterOpDone)  # nobody answers
        assert done.op_id == 2 and not done.outcomes[0].success and done.outcomes[0].error_kind == "timeout"
        assert "rank 0 did not answer" in done.outcomes[0].error_message
        assert harness.to_worker(DropAdapters) == DropAdapters(op_id=2, lora_ids=[7])  # the rollback
        # A late report is ignored: no second reply.
        outcome = AdapterOutcome(lora_id=7, success=True, lora_rank=8)
        harness.worker_out.send(AdapterReport(op_id=2, tp_rank=0, outcomes=[outcome]))
        harness.frontend_out.send(SchedulerStatsReq(op_id=4))
        assert harness.to_frontend(SchedulerStats).op_id == 4
        sampling = SamplingParams(max_new_tokens=1)
        harness.frontend_out.send(TokenizedGenerateReq(rid="r", input_ids=[1], sampling=sampling, lora_id=7))
        [delta] = harness.to_frontend(TokenDeltas).deltas
        assert delta.finish_reason == "error" and "adapter 7 not loaded" in delta.error_message
        harness.frontend_out.send(Shutdown())
        assert harness.wait_exit() == 0
    finally:
        harness.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_idle_scheduler_sleeps(harness):
    harness.worker_out.send(WorkerReady(tp_rank=0, max_total_tokens=100, context_length=64, vocab_size=32))
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
