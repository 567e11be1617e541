"""Per-key rate limits and the request field `priority` through a real server: the native and OpenAI routes and the
RPC answer the same limit; a refused request costs nothing; nothing leaks."""

from __future__ import annotations

import time

import pytest
from loraplex.frontend.entrypoints.rpc_client import RpcCallError, RpcClient

from tests.server_utils import ServerProcess

KEY = "tenant-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PER_MINUTE = 3  # one request back every 20 s: the test's requests all fall well inside one refill
PARAMS = {"max_new_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def server(llama_dir, adapter_dirs, tmp_path_factory):
    addr = f"ipc://{tmp_path_factory.mktemp('rpc')}/rpc.sock"
    with ServerProcess("--model-path", str(llama_dir), "--lora-paths", f"a4={adapter_dirs['a4']}",
                       "--max-lora-rank", "64", "--lora-target-modules", "all", "--max-total-tokens", "4096",
                       "--api-key", KEY, "--rpc-addr", addr, "--max-requests-per-minute-per-key", str(PER_MINUTE),
                       "--max-tokens-per-minute-per-key", "100000", "--scheduling-policy", "priority",
                       "--max-running-per-adapter", "1") as srv:
        yield srv, addr


def assert_rate_limited(resp) -> None:
    assert resp.status_code == 429, resp.text
    assert 1 <= int(resp.headers["Retry-After"]) <= 60 // PER_MINUTE
    error = resp.json()["error"]
    assert error["type"] == "rate_limited" and error["code"] == 429 and "retry after" in error["message"]


def test_rate_limit_429_on_every_route_and_priority_accepted(server):
    srv, addr = server
    started = time.monotonic()
    completion = {"model": "a4", "prompt": "hi", "max_tokens": 3, "priority": 2}
    with RpcClient(addr, api_key=KEY, timeout_s=60) as rpc:
        ok = srv.post("/generate", {"text": "hi", "sampling_params": PARAMS, "lora_path": "a4", "priority": -1},
                      headers=AUTH)
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3
        # Refused after the limit was checked (an unknown adapter): its request is given back, again and again.
        for _ in range(2 * PER_MINUTE):
            bad = srv.post("/generate", {"text": "hi", "sampling_params": PARAMS, "lora_path": "nonesuch"},
                           headers=AUTH)
            assert bad.status_code == 400, bad.text
        assert srv.post("/v1/completions", completion, headers=AUTH).status_code == 200
        assert len(rpc.generate("hi", PARAMS, priority=5)[0]["output_ids"]) == 3  # the third of the minute
        assert_rate_limited(srv.post("/generate", {"text": "hi", "sampling_params": PARAMS}, headers=AUTH))
        assert_rate_limited(srv.post("/v1/completions", completion, headers=AUTH))
        chat = {"model": "a4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert_rate_limited(srv.post("/v1/chat/completions", chat, headers=AUTH))
        with pytest.raises(RpcCallError, match="rate limit"):
            rpc.generate("hi", PARAMS)
    assert time.monotonic() - started < 60 / PER_MINUTE, "too slow to test: a request came back meanwhile"
    # Checked where it always is: a bad field is a 400 even past the limit; no key is still a 401.
    assert srv.post("/generate", {"text": "hi", "priority": "high"}, headers=AUTH).status_code == 400
    assert srv.post("/generate", {"text": "hi"}).status_code == 401
    info = srv.get("/server_info", headers=AUTH).json()
    assert (info["num_requests_in_flight"], info["num_adapter_holds"]) == (0, 0)
