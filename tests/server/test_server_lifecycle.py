"""Lifecycle: TP=2 against HF, a dying worker, clean shutdown, the SIGTERM drain, a worker fault, the in-process
Engine, servers side by side."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import psutil
import pytest
import requests
import torch
from loraplex.frontend.entrypoints.engine import Engine
from transformers import AutoTokenizer

from tests.reference import assert_greedy_match, hf_greedy, hf_model
from tests.server_utils import ServerProcess, fault_env

PROMPTS = ["Hello", "The quick brown fox jumps over", "Once upon a time there was a little", "1 2 3"]
GREEDY = {"max_new_tokens": 16, "temperature": 0}


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_tp2_greedy_matches_hf_and_shutdown_leaves_no_process(llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    with ServerProcess("--model-path", str(llama_dir), "--tp", "2", "--max-total-tokens", "2048") as server:
        pids = server.child_pids()
        assert len(pids) == 3  # scheduler + 2 workers
        outputs = server.post("/generate", {"text": PROMPTS, "sampling_params": GREEDY}).json()
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            ref, margins = hf_greedy(llama_dir, tokenizer(prompt)["input_ids"], 16, eos_token_ids=(2, 4))
            assert_greedy_match(out["output_ids"], ref, margins, prompt)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) is not None
    assert wait_until(lambda: not any(alive(p) for p in pids), 10), "orphan processes after SIGTERM"


def test_killed_worker_fails_requests_and_health(llama_dir):
    with ServerProcess("--model-path", str(llama_dir), "--max-total-tokens", "4096") as server:
        pids = server.get("/server_info").json()["process_ids"]
        worker_pid, scheduler_pid = pids["worker0"], pids["scheduler"]
        body = {"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        # A long generation in flight, then the worker dies under it.
        with requests.post(server.url + "/generate", json=body, stream=True, timeout=30) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith(b"data: "))
            t0 = time.monotonic()
            os.kill(worker_pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith(b"data: ")]
        assert time.monotonic() - t0 < 10
        assert b"error" in rest[-2] and rest[-1] == b"data: [DONE]"
        assert wait_until(lambda: server.get("/health").status_code == 503, 5)
        resp = server.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}}, timeout=10)
        assert resp.status_code == 503 and "unhealthy" in resp.json()["error"]["message"]
        assert wait_until(lambda: not alive(scheduler_pid), 10), "the scheduler survived its worker"


# Every forward pass of rank 0 sleeps this long first: a long generation stays in flight for as long as a test needs.
SLOW_STEPS = fault_env(stall_forward_on_rank=0, stall_forward_s=0.05)
LONG = {"max_new_tokens": 1500, "ignore_eos": True}


def data_lines(resp: requests.Response) -> list[bytes]:
    return [line for line in resp.iter_lines() if line.startswith(b"data: ")]


def in_background(fn, *args) -> tuple[threading.Thread, dict]:
    """Run fn(*args) on a thread; its return value (or exception) lands in the dict."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def in_flight(server: ServerProcess) -> int:
    return server.get("/server_info").json()["num_requests_in_flight"]


def test_sigterm_drains_in_flight_requests_then_aborts_and_exits_zero(llama_dir):
    with ServerProcess("--model-path", str(llama_dir), "--max-total-tokens", "4096", "--shutdown-timeout", "4",
                       env=SLOW_STEPS) as server:
        pids = server.child_pids()
        body = {"text": "Hi", "stream": True, "sampling_params": LONG}
        with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as long_resp:
            lines = long_resp.iter_lines()
            next(line for line in lines if line.startswith(b"data: "))
            short = {"text": "Hello", "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
            thread, short_out = in_background(server.post, "/generate", short, 60)
            assert wait_until(lambda: in_flight(server) == 2, 10)
            server.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            assert wait_until(lambda: server.get("/health").status_code == 503, 1), "health still 200 after SIGTERM"
            refused = server.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}}, timeout=10)
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            thread.join(timeout=30)
            assert short_out["value"].status_code == 200, short_out  # finished in time, in full
            assert short_out["value"].json()["meta_info"]["finish_reason"]["type"] == "length"
            rest = [line for line in lines if line.startswith(b"data: ")]
            waited = time.monotonic() - t0
        assert rest[-1] == b"data: [DONE]"
        last = json.loads(rest[-2][len(b"data: "):])
        assert last["meta_info"]["finish_reason"]["type"] == "abort", last["meta_info"]
        assert 0 < last["meta_info"]["completion_tokens"] < LONG["max_new_tokens"]
        assert 3.0 < waited < 15, waited  # ran until --shutdown-timeout, then ended
        assert server.proc.wait(timeout=30) == 0
    assert wait_until(lambda: not any(alive(p) for p in pids), 10), "orphan processes after SIGTERM"


def test_killed_worker_tp2_fails_pending_request_and_stops_the_rest(llama_dir):
    with ServerProcess("--model-path", str(llama_dir), "--tp", "2", "--max-total-tokens", "4096",
                       env=SLOW_STEPS) as server:
        pids = server.get("/server_info").json()["process_ids"]
        thread, out = in_background(server.post, "/generate", {"text": "Hi", "sampling_params": LONG}, 60)
        assert wait_until(lambda: in_flight(server) == 1, 10)
        os.kill(pids["worker1"], signal.SIGKILL)
        t0 = time.monotonic()
        thread.join(timeout=10)
        assert not thread.is_alive(), "the pending request did not end"
        assert out["value"].status_code == 503, out
        assert time.monotonic() - t0 < 10
        assert server.get("/health").status_code == 503
        assert wait_until(lambda: not alive(pids["scheduler"]) and not alive(pids["worker0"]), 10), \
            "survivors left running"
        resp = server.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}}, timeout=10)
        assert resp.status_code == 503 and "unhealthy" in resp.json()["error"]["message"]
        assert server.proc.poll() is None  # the frontend stays up, answering 503, until it is told to stop
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0


def test_worker_fault_in_forward_takes_the_server_down(llama_dir):
    with ServerProcess("--model-path", str(llama_dir), "--max-total-tokens", "2048",
                       env=fault_env(crash_forward_on_rank=0)) as server:
        pids = server.child_pids()
        resp = server.post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4}}, timeout=30)
        assert resp.status_code == 503 and "injected fault" in resp.json()["error"]["message"], resp.text
        health = server.get("/health")
        assert health.status_code == 503 and "injected fault" in health.json()["reason"]
        assert wait_until(lambda: not any(alive(p) for p in pids), 10), "processes left after the fault"
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0


def test_engine_sync_async_stream_side_by_side(llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    ref, margins = hf_greedy(llama_dir, tokenizer(PROMPTS[1])["input_ids"], 16, eos_token_ids=(2, 4))
    with Engine(model_path=str(llama_dir), max_total_tokens=2048, device="cpu") as first, \
            Engine(model_path=str(llama_dir), max_total_tokens=2048, device="cpu") as second:
        out = first.generate(PROMPTS[1], sampling_params=GREEDY)
        assert_greedy_match(out["output_ids"], ref, margins, "engine")
        assert second.generate(PROMPTS[1], sampling_params=GREEDY)["output_ids"] == out["output_ids"]
        batch = first.generate(PROMPTS, sampling_params=GREEDY)
        assert len(batch) == len(PROMPTS) and batch[1]["output_ids"] == out["output_ids"]
        chunks = list(first.generate(PROMPTS[1], sampling_params=GREEDY, stream=True))
        assert chunks[-1]["text"] == out["text"]

        async def use_async():  # an event loop started after the Engine was built
            result = await second.async_generate(PROMPTS[1], sampling_params=GREEDY)
            streamed = [c async for c in await second.async_generate(PROMPTS[1], sampling_params=GREEDY,
                                                                    stream=True)]
            return result, streamed

        result, streamed = asyncio.run(use_async())
        assert result["output_ids"] == out["output_ids"] and streamed[-1]["text"] == out["text"]
        with pytest.raises(ValueError, match="max_new_tokens"):
            first.generate("x", sampling_params={"max_new_tokens": -1})
        # the sampling options and prompt logprobs, as /generate takes them
        ids = tokenizer(PROMPTS[1])["input_ids"]
        many = first.generate(PROMPTS[1], sampling_params={**GREEDY, "n": 2, "repetition_penalty": 1.3},
                              return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
        assert len(many) == 2 and many[0]["output_ids"] == many[1]["output_ids"]
        with torch.inference_mode():
            ref_lp = hf_model(str(llama_dir))(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
        values = [e[0] for e in many[0]["meta_info"]["input_token_logprobs"]]
        assert values[0] is None and len(values) == len(ids)
        assert all(abs(v - float(ref_lp[i, ids[i + 1]])) < 1e-3 for i, v in enumerate(values[1:]))
        pids = list(first.runtime.procs.pids().values())
    assert wait_until(lambda: not any(alive(p) for p in pids), 10)
