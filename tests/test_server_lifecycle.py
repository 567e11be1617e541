"""Lifecycle: TP=2 against HF, a dying worker, clean shutdown, the in-process Engine, servers side by side."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest
import requests
from transformers import AutoTokenizer

from frontend.engine import Engine
from tests.reference import assert_greedy_match, hf_greedy
from tests.server_utils import ServerProcess

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
        worker_pid = server.get("/server_info").json()["process_ids"]["worker0"]
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
        pids = list(first.runtime.procs.pids().values())
    assert wait_until(lambda: not any(alive(p) for p in pids), 10)
