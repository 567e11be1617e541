"""A CPU server under vLLM's VLLM_CPU_OMP_THREADS_BIND: the worker's threads on the named core, the frontend and the
scheduler on the others (protocol/cpu_cores.py), the plan logged once, and the server serving as before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from loraplex.protocol.cpu_cores import BIND_ENV

from tests.server_utils import ServerProcess

CORES = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
def test_worker_threads_pinned_and_services_kept_off_them(llama_dir: Path) -> None:
    worker_core, service_cores = CORES[-1], set(CORES[:-1])
    with ServerProcess("--model-path", str(llama_dir), env={BIND_ENV: str(worker_core)}) as server:
        info = server.get("/server_info").json()
        pids = info["process_ids"]
        assert os.sched_getaffinity(pids["worker0"]) == {worker_core}
        assert os.sched_getaffinity(pids["scheduler"]) == service_cores
        assert os.sched_getaffinity(server.proc.pid) == service_cores  # the frontend
        body = {"model": info["served_model_name"], "prompt": [5, 17, 33, 2, 9], "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}
        answer = server.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        log = server.log()
    assert log.count(f"1 compute threads pinned to cores {worker_core}; frontend and scheduler on") == 1
