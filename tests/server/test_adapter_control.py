"""The adapter control plane end to end: deadlines and rollback, drain timeouts, in-place reloads and pins,
the state file across a restart, the resolver, and the updates gate."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import threading
import time

import requests

from tests.server.test_server_lifecycle import wait_until
from tests.server_utils import ServerProcess, fault_env
from tests.unit.test_metrics import parse as parse_metrics
from tests.unit.test_metrics import value as metric

LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "64", "--lora-target-modules", "all", "--max-total-tokens", "8192",
              "--context-length", "2048")
SLOW_STEPS = fault_env(stall_forward_on_rank=0, stall_forward_s=0.05)  # ~20 decode steps a second
GREEDY = {"max_new_tokens": 8, "temperature": 0}
LONG = {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}  # ~6 s under SLOW_STEPS


def load(server, name, path, path_prefix="", **extra):
    return server.post(f"{path_prefix}/load_lora_adapter", {"lora_name": name, "lora_path": str(path), **extra})


def unload(server, name, path_prefix=""):
    return server.post(f"{path_prefix}/unload_lora_adapter", {"lora_name": name})


def gen(server, name, params=GREEDY, prompt="Once upon a time"):
    return server.post("/generate", {"text": prompt, "lora_path": name, "sampling_params": params})


def adapters(server) -> dict[str, dict]:
    return {row["lora_name"]: row for row in server.get("/lora_adapters").json()["adapters"]}


def in_background(fn, *args) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


def no_leaks(server) -> None:
    info = server.get("/server_info").json()
    assert info["num_requests_in_flight"] == 0 and info["num_adapter_holds"] == 0


def test_rank_that_never_answers_fails_the_load_in_time_and_it_is_rolled_back(llama_dir, adapter_dirs):
    with ServerProcess("--model-path", str(llama_dir), "--tp", "2", *LORA_FLAGS, "--lora-load-timeout", "2",
                       env=fault_env(hang_load_on_rank=1, fail_load_name="stuck")) as server:
        t0 = time.monotonic()
        resp = load(server, "stuck", adapter_dirs["a4"])
        elapsed = time.monotonic() - t0
        assert resp.status_code == 503, resp.text
        message = resp.json()["error_message"]
        assert "rank 1" in message and "'stuck'" in message and "--lora-load-timeout" in message
        assert 1.5 < elapsed < 10
        assert "stuck" not in adapters(server)
        assert server.get("/health").status_code == 200
        # Rolled back on rank 0 too: the scheduler and every rank forgot it; the next load goes through at once.
        assert load(server, "fine", adapter_dirs["a4"]).status_code == 200
        assert gen(server, "fine").status_code == 200
        resp = load(server, "stuck", adapter_dirs["a4"], path_prefix="/v1")
        assert resp.status_code == 503 and "rank 1" in resp.json()["error"]["message"]
        assert "rolled back" in server.log()
        metrics = parse_metrics(server.get("/metrics").text)[1]
        assert metric(metrics, "loraplex_adapter_operations_total", op="load", result="failure") == 2
        no_leaks(server)


def test_drain_timeout_is_409_on_both_apis_and_the_adapter_keeps_serving(llama_dir, adapter_dirs):
    with ServerProcess("--model-path", str(llama_dir), *LORA_FLAGS, "--lora-drain-timeout", "1",
                       "--lora-paths", f"a={adapter_dirs['a4']}",
                       env=SLOW_STEPS) as server:
        running = in_background(gen, server, "a", LONG)
        assert wait_until(lambda: adapters(server)["a"]["requests_in_flight"] == 1, 10)
        for prefix in ("", "/v1"):
            resp = unload(server, "a", prefix)
            assert resp.status_code == 409, resp.text
            assert "'a'" in resp.text and "in flight" in resp.text
        row = adapters(server)["a"]
        assert not row["draining"]
        assert gen(server, "a").status_code == 200  # still loaded and serving
        assert running.result(timeout=60).status_code == 200
        assert unload(server, "a").status_code == 200
        assert gen(server, "a").status_code == 400
        no_leaks(server)


def test_inplace_reload_keeps_its_pin_at_the_limit_and_running_requests_finish_on_old_weights(llama_dir,
                                                                                              adapter_dirs):
    # Two slots: at most one pinned adapter, so "p" alone is at the pin limit.
    with ServerProcess("--model-path", str(llama_dir), *LORA_FLAGS, "--max-loras-per-batch", "2",
                       env=SLOW_STEPS) as server:
        assert load(server, "p", adapter_dirs["a16"], pinned=True).status_code == 200
        assert load(server, "q", adapter_dirs["a4"], pinned=True).status_code == 400  # the limit holds
        old_ids = gen(server, "p", LONG).json()["output_ids"]

        # Through /v1 without `pinned`: the pin stays.
        resp = load(server, "p", adapter_dirs["a16"], path_prefix="/v1", load_inplace=True)
        assert resp.status_code == 200, resp.text
        assert adapters(server)["p"]["pinned"] is True
        # With pinned=true at the limit: works (the old id's pin moves to the new one).
        resp = load(server, "p", adapter_dirs["a16"], path_prefix="/v1", load_inplace=True, pinned=True)
        assert resp.status_code == 200, resp.text

        # A request running across the swap finishes on the old weights; new ones get the new weights.
        running = in_background(gen, server, "p", LONG)
        assert wait_until(lambda: adapters(server)["p"]["requests_in_flight"] == 1, 10)
        time.sleep(0.5)  # some tokens decoded on the old weights
        resp = load(server, "p", adapter_dirs["a64"], path_prefix="/v1", load_inplace=True)
        assert resp.status_code == 200, resp.text
        new_ids = gen(server, "p", LONG).json()["output_ids"]
        assert running.result(timeout=60).json()["output_ids"] == old_ids
        assert new_ids != old_ids
        assert adapters(server)["p"]["pinned"] is True
        # The old weights are dropped once nothing uses them: only one entry remains.
        assert wait_until(lambda: server.get("/server_info").json()["num_adapter_entries"] == 1, 10)
        no_leaks(server)


def test_state_file_restores_adapters_and_pins_after_a_restart(llama_dir, adapter_dirs, tmp_path):
    state = tmp_path / "state.json"
    flags = ("--model-path", str(llama_dir), *LORA_FLAGS, "--lora-state-file", str(state))
    with ServerProcess(*flags) as server:
        assert load(server, "a", adapter_dirs["a4"], pinned=True).status_code == 200
        assert load(server, "b", adapter_dirs["a16"]).status_code == 200
        assert load(server, "gone", adapter_dirs["a8"]).status_code == 200
        assert unload(server, "gone").status_code == 200
        before = {name: gen(server, name).json()["output_ids"] for name in ("a", "b", None)}
        saved = json.loads(state.read_text())
        assert [(e["lora_name"], e["pinned"]) for e in saved["adapters"]] == [("a", True), ("b", False)]
    with ServerProcess(*flags) as server:
        rows = adapters(server)
        assert {name: row["pinned"] for name, row in rows.items()} == {"a": True, "b": False}
        assert {name: gen(server, name).json()["output_ids"] for name in ("a", "b", None)} == before

    # An entry that no longer loads is skipped; --lora-paths wins a name clash.
    saved["adapters"].append({"lora_name": "broken", "lora_path": str(tmp_path / "nowhere"), "pinned": False})
    state.write_text(json.dumps(saved))
    with ServerProcess(*flags, "--lora-paths", f"b={adapter_dirs['a8']}") as server:
        rows = adapters(server)
        assert set(rows) == {"a", "b"} and rows["b"]["lora_path"] == str(adapter_dirs["a8"])
        assert "broken" in server.log() and "skipped" in server.log()


def test_resolver_loads_an_unknown_adapter_once_on_first_use(llama_dir, adapter_dirs, tmp_path):
    resolver = tmp_path / "resolver"
    resolver.mkdir()
    shutil.copytree(adapter_dirs["a4"], resolver / "x")
    (resolver / "broken").mkdir()
    outside = tmp_path / "outside"
    shutil.copytree(adapter_dirs["a8"], outside)
    os.symlink(outside, resolver / "escape")
    with ServerProcess("--model-path", str(llama_dir), *LORA_FLAGS, "--lora-resolver-dir", str(resolver)) as server:
        barrier = threading.Barrier(4)

        def first_use(_):
            barrier.wait()
            return gen(server, "x")

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(first_use, range(4)))
        assert [r.status_code for r in results] == [200] * 4
        assert len({tuple(r.json()["output_ids"]) for r in results}) == 1
        metrics = parse_metrics(server.get("/metrics").text)[1]
        assert metric(metrics, "loraplex_adapter_operations_total", op="load", result="success") == 1
        assert adapters(server)["x"]["lora_path"] == str(resolver / "x")

        resp = server.post("/v1/completions", {"model": "x", "prompt": "Hi", "max_tokens": 4})
        assert resp.status_code == 200 and resp.json()["model"] == "x"
        assert server.post("/v1/completions", {"model": "nope", "prompt": "Hi"}).status_code == 404
        assert gen(server, "nope").status_code == 400
        for name in ("broken", "escape"):
            assert gen(server, name).status_code == 400
            resp = server.post("/v1/completions", {"model": name, "prompt": "Hi"})
            assert resp.status_code == 400 and repr(name) in resp.json()["error"]["message"]
        for name in ("../x", "a/b", ".hidden"):
            assert 400 <= gen(server, name).status_code < 500
        assert set(adapters(server)) == {"x"}
        no_leaks(server)


def test_disable_lora_updates_refuses_every_change_after_start(llama_dir, adapter_dirs):
    with ServerProcess("--model-path", str(llama_dir), *LORA_FLAGS, "--disable-lora-updates", "--api-key", "k",
                       "--lora-paths", f"a={adapter_dirs['a4']}") as server:
        auth = {"Authorization": "Bearer k"}
        assert server.post("/load_lora_adapter", {"lora_name": "b", "lora_path": "x"}).status_code == 401
        for prefix in ("", "/v1"):
            resp = server.post(f"{prefix}/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapter_dirs["a8"])},
                               headers=auth)
            assert resp.status_code == 403 and "--disable-lora-updates" in resp.text
            resp = server.post(f"{prefix}/unload_lora_adapter", {"lora_name": "a"}, headers=auth)
            assert resp.status_code == 403
        resp = server.post("/load_lora_adapter", {"adapters": [{"lora_name": "c", "lora_path": "y"}]}, headers=auth)
        assert resp.status_code == 403
        resp = server.post("/generate", {"text": "Hi", "lora_path": "a", "sampling_params": GREEDY}, headers=auth)
        assert resp.status_code == 200
        assert set(adapters_with_key(server, auth)) == {"a"}


def adapters_with_key(server, headers) -> dict[str, dict]:
    rows = requests.get(server.url + "/lora_adapters", headers=headers, timeout=30).json()["adapters"]
    return {row["lora_name"]: row for row in rows}
