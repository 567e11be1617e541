"""The rolling restart (deploy/k8s/README.md, "Rolling restarts"): two servers behind a load balancer that follows
their /health (tests/health_proxy.py, what a Service behind a gateway does), restarted one at a time while clients
send greedy requests for the base and two adapters. SIGTERM drains a server (health 503, in-flight requests finish),
the balancer sends new requests to the other one, and the restarted server comes back with every adapter: one from
--lora-paths, one loaded at run time through the API that only its --lora-state-file brings back."""

from __future__ import annotations

import itertools
import json
import re
import signal
import threading

import pytest
import requests

from tests.health_proxy import HealthProxy
from tests.server.test_server_lifecycle import wait_until
from tests.server_utils import ServerProcess, fault_env

# Each forward pass stalls a little, so requests are still running when SIGTERM comes (the drain has work to finish).
SLOW_STEPS = fault_env(stall_forward_on_rank=0, stall_forward_s=0.02)
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
PROMPTS = ["Once upon a time", "The quick brown fox", "1 2 3"]
MODELS = [None, "boot", "live"]  # the base; an adapter from --lora-paths; one loaded at run time through the API
NUM_CLIENTS = 3
RESTARTS = [0, 1, 0]  # which server each restart takes down


def flags(llama_dir, adapter_dirs, state_file) -> tuple[str, ...]:
    return ("--model-path", str(llama_dir), "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all",
            "--max-total-tokens", "2048", "--context-length", "256", "--lora-paths", f"boot={adapter_dirs['a4']}",
            "--lora-state-file", str(state_file), "--shutdown-timeout", "20")


def adapter_list(url: str) -> dict[str, tuple[str, bool]]:
    rows = requests.get(url + "/lora_adapters", timeout=30).json()["adapters"]
    return {row["lora_name"]: (row["lora_path"], row["pinned"]) for row in rows}


def generate(url: str, prompt: str, model: str | None, stream: bool = False) -> tuple[int, str]:
    """The status and the whole answer's text, which must have ended by its length (not cut short or aborted); for
    anything else, what came back instead."""
    body = {"text": prompt, "lora_path": model, "sampling_params": GREEDY, "stream": stream}
    resp = requests.post(url + "/generate", json=body, timeout=120)
    if resp.status_code != 200:
        return resp.status_code, resp.text
    if stream:  # the proxy relays the events whole; each carries the text so far
        events = [line[6:] for line in resp.content.decode().splitlines() if line.startswith("data: ")]
        if len(events) < 2 or events[-1] != "[DONE]":
            return 200, f"stream cut short: {events[-2:]}"
        out = json.loads(events[-2])
    else:
        out = resp.json()
    if out["meta_info"]["finish_reason"]["type"] != "length":
        return 200, f"ended by {out['meta_info']['finish_reason']}: {out['text']!r}"
    return 200, out["text"]


@pytest.fixture(scope="module")
def pair(llama_dir, adapter_dirs, tmp_path_factory):
    """Two servers, each with its own state file, and "live" loaded on each through its API (as an operator loads
    an adapter on every pod)."""
    root = tmp_path_factory.mktemp("rolling")
    server_flags = [flags(llama_dir, adapter_dirs, root / f"state{i}.json") for i in range(2)]
    servers = [ServerProcess(*f, env=SLOW_STEPS, healthy=False) for f in server_flags]  # both start at once
    try:
        for server in servers:
            server.wait_healthy(180)
            resp = server.post("/load_lora_adapter", {"lora_name": "live", "lora_path": str(adapter_dirs["a8"])})
            assert resp.status_code == 200, resp.text
        yield servers, server_flags
    finally:
        for server in servers:
            server.stop()


def test_restarting_one_server_at_a_time_under_load_fails_no_request_and_keeps_every_adapter(pair):
    servers, server_flags = pair
    before = [adapter_list(s.url) for s in servers]
    assert set(before[0]) == {"boot", "live"} and before[0] == before[1]
    expected = {(p, m): generate(servers[0].url, p, m)[1] for p in PROMPTS for m in MODELS}
    assert all(generate(servers[1].url, p, m) == (200, text) for (p, m), text in expected.items())
    for prompt in PROMPTS:  # the adapters change the answers: a lost adapter could not go unnoticed
        assert len({expected[prompt, m] for m in MODELS}) == len(MODELS), prompt

    proxy = HealthProxy([s.url for s in servers])
    stop = threading.Event()
    results: list[tuple[str, str | None, int, str]] = []  # prompt, model, status, text (or the error)
    lock = threading.Lock()

    def client(offset: int, stream: bool) -> None:
        for prompt, model in itertools.islice(itertools.cycle(expected), offset, None):
            if stop.is_set():
                return
            try:
                outcome = generate(proxy.url, prompt, model, stream)
            except requests.RequestException as e:
                outcome = (-1, repr(e))
            with lock:
                results.append((prompt, model, *outcome))

    # The last client streams: a drain must finish a stream in flight as it finishes a whole answer.
    clients = [threading.Thread(target=client, args=(i * 3, i == NUM_CLIENTS - 1)) for i in range(NUM_CLIENTS)]
    drained = []
    try:
        assert wait_until(lambda: all(proxy.ready), 10), "the proxy never saw both servers ready"
        for thread in clients:
            thread.start()
        for index in RESTARTS:
            old = servers[index]
            n_before = len(results)
            assert wait_until(lambda n=n_before: len(results) >= n + NUM_CLIENTS, 60), "no traffic before the restart"
            # What the kubelet sends, here with no preStop pause: the proxy may still send this server a request,
            # which it refuses with 503 while it drains, and the proxy sends to the other one.
            old.proc.send_signal(signal.SIGTERM)
            assert old.proc.wait(timeout=60) == 0
            drained += [int(n) for n in re.findall(r"draining (\d+) request", old.log())]
            old.stop()
            servers[index] = ServerProcess(*server_flags[index], env=SLOW_STEPS)  # the new pod: a new address
            proxy.set_backend(index, servers[index].url)
            assert adapter_list(servers[index].url) == before[index]
            assert wait_until(lambda i=index: proxy.ready[i], 10)
        n_after = len(results)
        assert wait_until(lambda: len(results) >= n_after + 2 * NUM_CLIENTS, 60), "no traffic after the last restart"
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=60)
        proxy.close()

    failed = [r for r in results if (r[2], r[3]) != (200, expected[r[0], r[1]])]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:5]}"
    assert len(drained) == len(RESTARTS) and sum(drained) > 0, f"in flight at SIGTERM: {drained}"
    assert [adapter_list(s.url) for s in servers] == before
    print(f"{len(results)} requests, {proxy.retries} retried by the proxy, in flight at each SIGTERM: {drained}")
