"""Dynamic adapters: load and unload at run time, the same on every rank, with nothing lost or leaked."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import threading
import time

import psutil
import pytest
import requests
from loraplex.protocol.adapters.lora_targets import TARGET_MODULES
from transformers import AutoTokenizer

from tests.builders import build_lora_adapter
from tests.lora_helpers import build_dora_adapters, build_peft_adapter
from tests.reference import SHARED_PREFIX_PROMPTS, assert_greedy_match, hf_greedy
from tests.server_utils import ServerProcess, fault_env
from tests.unit.test_metrics import SERIES as METRIC_SERIES
from tests.unit.test_metrics import parse as parse_metrics
from tests.unit.test_metrics import value as metric

GREEDY = {"max_new_tokens": 12, "temperature": 0}
PROMPT = "Once upon a time"
DYNAMIC_FLAGS = ("--enable-lora", "--max-lora-rank", "64", "--lora-target-modules", "all", "--max-loras-per-batch",
                 "4", "--max-total-tokens", "8192", "--context-length", "2048")


@pytest.fixture(scope="module")
def dynamic_server(llama_dir):
    with ServerProcess("--model-path", str(llama_dir), *DYNAMIC_FLAGS) as server:
        yield server


def gen(server, name, prompt=PROMPT, **extra):
    return server.post("/generate", {"text": prompt, "lora_path": name, "sampling_params": GREEDY, **extra})


def load(server, name, path, **extra):
    return server.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path), **extra})


def unload(server, name, timeout=60):
    return server.post("/unload_lora_adapter", {"lora_name": name}, timeout=timeout)


def run_script(server, adapter_dirs, expect):
    """Load / generate / unload / reload; expect(name_in_static_server, output_ids) checks each generation."""
    expect(None, gen(server, None).json()["output_ids"])
    assert load(server, "x", adapter_dirs["a4"]).json()["success"]
    expect("a4", gen(server, "x").json()["output_ids"])
    assert load(server, "y", adapter_dirs["a16"]).json()["loaded_adapters"].keys() == {"x", "y"}
    expect("a16", gen(server, "y").json()["output_ids"])
    expect("a4", gen(server, "x").json()["output_ids"])
    assert unload(server, "x").json()["success"]
    assert gen(server, "x").status_code == 400
    assert load(server, "x", adapter_dirs["a8"]).status_code == 200  # same name, other weights
    expect("a8", gen(server, "x").json()["output_ids"])
    resp = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapter_dirs["a64"]),
                                                 "load_inplace": True})
    assert resp.status_code == 200, resp.text
    expect("a64", gen(server, "x").json()["output_ids"])
    for name in ("x", "y"):
        assert server.post("/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
    assert server.get("/lora_adapters").json()["adapters"] == []
    assert len(server.get("/v1/models").json()["data"]) == 1  # the base model only


def test_scripted_sequence_equals_static_start(dynamic_server, static_lora_server, adapter_dirs):
    def expect(name, output_ids):
        assert gen(static_lora_server, name).json()["output_ids"] == output_ids, name

    run_script(dynamic_server, adapter_dirs, expect)


def test_tp2_scripted_sequence_and_fault_on_one_rank(llama_dir, adapter_dirs):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    prompt_ids = tokenizer(PROMPT)["input_ids"]

    def expect(name, output_ids):
        adapter = None if name is None else adapter_dirs[name]
        ref, margins = hf_greedy(llama_dir, prompt_ids, 12, adapter, eos_token_ids=(2, 4))
        assert_greedy_match(output_ids, ref, margins, str(name))

    with ServerProcess("--model-path", str(llama_dir), "--tp", "2", *DYNAMIC_FLAGS,
                       env=fault_env(fail_load_on_rank=1, fail_load_name="faulty")) as server:
        run_script(server, adapter_dirs, expect)
        resp = load(server, "faulty", adapter_dirs["a4"])
        assert resp.status_code == 500 and "rank 1" in resp.json()["error_message"]
        assert "faulty" not in server.get("/lora_adapters").text
        assert server.get("/health").status_code == 200
        assert load(server, "fine", adapter_dirs["a4"]).status_code == 200
        expect("a4", gen(server, "fine").json()["output_ids"])
        info = server.get("/server_info").json()
        assert info["slot_lora_ids"].count(-1) >= 3  # the failed adapter holds no slot


@pytest.fixture(scope="module")
def big_rank_adapter(tmp_path_factory, llama_dir):
    path = tmp_path_factory.mktemp("big") / "r128"
    build_lora_adapter(llama_dir, path, r=128, lora_alpha=128, target_modules=TARGET_MODULES, seed=9)
    return path


def test_error_cases_answer_status_and_message(dynamic_server, adapter_dirs, big_rank_adapter, tmp_path):
    server = dynamic_server
    (tmp_path / "empty").mkdir()
    (tmp_path / "malformed").mkdir()
    (tmp_path / "malformed" / "adapter_config.json").write_text("[1, 2")
    assert load(server, "dup", adapter_dirs["a4"]).status_code == 200
    try:
        cases = [  # (body, native status, vLLM status, fragment)
            ({"lora_name": "dup", "lora_path": str(adapter_dirs["a8"])}, 400, 400, "has already been loaded"),
            ({"lora_name": "m", "lora_path": str(tmp_path / "nope")}, 400, 404, "does not exist"),
            ({"lora_name": "e", "lora_path": str(tmp_path / "empty")}, 400, 400, "adapter_config.json"),
            ({"lora_name": "f", "lora_path": str(tmp_path / "malformed")}, 400, 400, "adapter_config.json"),
            ({"lora_name": "big", "lora_path": str(big_rank_adapter)}, 400, 400, "max-lora-rank"),
            ({"lora_name": "bad:name", "lora_path": str(adapter_dirs["a4"])}, 400, 400, "bad:name"),
        ]
        for body, native_status, vllm_status, fragment in cases:
            resp = server.post("/load_lora_adapter", body)
            assert resp.status_code == native_status and fragment in resp.json()["error_message"], resp.text
            assert body["lora_name"] in resp.json()["error_message"]
            resp = server.post("/v1/load_lora_adapter", body)
            assert resp.status_code == vllm_status and fragment in resp.json()["error"]["message"], resp.text
        resp = server.post("/load_lora_adapter", {"lora_name": 5, "lora_path": "x"})
        assert resp.status_code == 400
        # pins: at most max-loras-per-batch - 1 = 3
        pins = [load(server, f"p{i}", adapter_dirs["a4"], pinned=True) for i in range(4)]
        assert [r.status_code for r in pins] == [200, 200, 200, 400]
        assert "too many pinned" in pins[3].json()["error_message"]
        for i in range(3):
            assert unload(server, f"p{i}").status_code == 200
        resp = unload(server, "ghost")
        assert resp.status_code == 400 and "ghost" in resp.json()["error_message"]
        resp = server.post("/v1/unload_lora_adapter", {"lora_name": "ghost"})
        assert resp.status_code == 404 and "ghost" in resp.json()["error"]["message"]
        assert gen(server, "ghost").status_code == 400
        resp = server.post("/v1/completions", {"model": "ghost", "prompt": "x", "max_tokens": 2})
        assert resp.status_code == 404 and "ghost" in resp.json()["error"]["message"]
        batch = server.post("/load_lora_adapter", {"adapters": [
            {"lora_name": "ok1", "lora_path": str(adapter_dirs["a8"])},
            {"lora_name": "bad1", "lora_path": str(tmp_path / "empty")}]})
        results = {r["lora_name"]: r["success"] for r in batch.json()["results"]}
        assert results == {"ok1": True, "bad1": False} and "ok1" in batch.json()["loaded_adapters"]
        out = server.post("/unload_lora_adapter", {"lora_names": ["ok1", "ghost"]}).json()
        assert [r["success"] for r in out["results"]] == [True, False]
    finally:
        unload(server, "dup")
    assert server.get("/health").status_code == 200


def test_path_root_and_api_keys(llama_dir, adapter_dirs, tmp_path):
    root = adapter_dirs["a4"].parent
    (tmp_path / "link").symlink_to(root.parent)
    with ServerProcess("--model-path", str(llama_dir), *DYNAMIC_FLAGS, "--lora-path-root", str(root),
                       "--api-key", "user-key", "--admin-api-key", "admin-key") as server:
        user = {"Authorization": "Bearer user-key"}
        admin = {"Authorization": "Bearer admin-key"}
        body = {"lora_name": "a", "lora_path": str(adapter_dirs["a4"])}
        assert server.get("/health").status_code == 200
        for path, json_body in (("/generate", {"text": "x"}), ("/load_lora_adapter", body)):
            resp = server.post(path, json_body)
            assert resp.status_code == 401 and "API key" in resp.json()["error"]["message"]
        assert server.get("/v1/models").status_code == 401
        assert server.post("/load_lora_adapter", body, headers=user).status_code == 401
        assert server.post("/load_lora_adapter", body, headers=admin).status_code == 200
        for outside in (str(root / ".." / ".."), str(tmp_path / "link" / "x"), str(tmp_path)):
            resp = server.post("/load_lora_adapter", {"lora_name": "o", "lora_path": outside}, headers=admin)
            assert resp.status_code == 400 and "outside" in resp.json()["error_message"], resp.text
        resp = server.post("/generate", {"text": "x", "lora_path": "a", "sampling_params": GREEDY}, headers=user)
        assert resp.status_code == 200


def test_path_root_checks_every_file_on_the_worker(llama_dir, adapter_dirs, tmp_path):
    # The directory is inside the root, so only the worker's per-file check can see that its weights are not.
    root = tmp_path / "root"
    (root / "inside").mkdir(parents=True)
    shutil.copy(adapter_dirs["a4"] / "adapter_config.json", root / "inside")
    (root / "inside" / "adapter_model.safetensors").symlink_to(adapter_dirs["a4"] / "adapter_model.safetensors")
    shutil.copytree(adapter_dirs["a8"], root / "ok")
    with ServerProcess("--model-path", str(llama_dir), *DYNAMIC_FLAGS, "--lora-path-root", str(root)) as server:
        for route in ("/load_lora_adapter", "/v1/load_lora_adapter"):
            resp = server.post(route, {"lora_name": "sneaky", "lora_path": str(root / "inside")})
            message = resp.json()["error_message"] if route == "/load_lora_adapter" else resp.json()["error"]["message"]
            assert resp.status_code == 400, resp.text
            for fragment in ("'sneaky'", "adapter_model.safetensors", "--lora-path-root"):
                assert fragment in message, (fragment, message)
        assert "sneaky" not in server.get("/lora_adapters").text
        assert load(server, "ok", root / "ok").status_code == 200
        assert gen(server, "ok").status_code == 200


def test_metrics_after_adapter_and_base_requests(dynamic_server, adapter_dirs, llama_dir):
    server = dynamic_server
    assert load(server, "metered", adapter_dirs["a4"]).status_code == 200
    try:
        outputs = [gen(server, name).json()["meta_info"] for name in ("metered", "metered", None)]
        types, samples = parse_metrics(server.get("/metrics").text)
    finally:
        unload(server, "metered")
    assert types == METRIC_SERIES
    assert metric(samples, "loraplex_adapter_requests_total", adapter="metered") == 2
    assert metric(samples, "loraplex_adapter_prompt_tokens_total", adapter="metered") == sum(
        m["prompt_tokens"] for m in outputs[:2])
    assert metric(samples, "loraplex_adapter_generation_tokens_total", adapter="metered") == sum(
        m["completion_tokens"] for m in outputs[:2])
    assert metric(samples, "loraplex_adapter_requests_total", adapter=llama_dir.name) >= 1  # base: the served name
    assert metric(samples, "loraplex_adapter_resident", adapter="metered") in (0, 1)
    assert metric(samples, "loraplex_adapters_loaded") >= 1
    assert metric(samples, "loraplex_adapter_operations_total", op="load", result="success") >= 1
    assert metric(samples, "loraplex_prefix_cache_hit_tokens_total") == 0
    assert metric(samples, "loraplex_e2e_request_latency_seconds_count") >= 3


def test_storm_of_loads_under_traffic(dynamic_server, adapter_dirs, tmp_path):
    server = dynamic_server
    (tmp_path / "invalid").mkdir()
    assert load(server, "steady", adapter_dirs["a16"]).status_code == 200
    for i in range(3):
        assert load(server, f"u{i}", adapter_dirs["a8"]).status_code == 200
    stop = threading.Event()
    statuses: list[int] = []

    def background(name):
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            statuses.append(gen(server, name).status_code)

    paths = [adapter_dirs[n] for n in ("a4", "a8", "a16", "a32", "a64")]
    with concurrent.futures.ThreadPoolExecutor(80) as pool:
        traffic = [pool.submit(background, name) for name in (None, "steady", None)]
        # requests in flight on the adapters we are about to unload
        held = [pool.submit(gen, server, f"u{i}", PROMPT, sampling_params={"max_new_tokens": 64,
                                                                             "ignore_eos": True})
                for i in range(3)]
        time.sleep(0.2)
        valid = [pool.submit(load, server, f"v{i}", paths[i % 5]) for i in range(10)]
        missing = [pool.submit(load, server, f"m{i}", tmp_path / f"none{i}") for i in range(25)]
        invalid = [pool.submit(load, server, f"i{i}", tmp_path / "invalid") for i in range(25)]
        unloads = [pool.submit(unload, server, f"u{i}") for i in range(3)]
        assert all(f.result().status_code == 200 for f in valid)
        assert all(f.result().status_code == 400 for f in missing + invalid)
        assert all(f.result().json()["success"] for f in unloads)
        assert all(len(f.result().json()["output_ids"]) == 64 for f in held)
        stop.set()
        for f in traffic:
            f.result()
    assert statuses and set(statuses) == {200}, statuses
    assert load(server, "fresh", adapter_dirs["a32"]).status_code == 200
    assert gen(server, "fresh").status_code == 200
    for name in ["steady", "fresh"] + [f"v{i}" for i in range(10)]:
        assert unload(server, name).status_code == 200
    info = server.get("/server_info").json()
    assert info["num_adapter_entries"] == 0 and info["num_adapter_holds"] == 0 and info["num_requests_in_flight"] == 0


def timed_unload(server, name):
    t0 = time.monotonic()
    resp = unload(server, name, timeout=15)
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    assert time.monotonic() - t0 < 10


def test_unload_never_hangs(dynamic_server, adapter_dirs):
    server = dynamic_server
    long = {"max_new_tokens": 2000, "ignore_eos": True}  # seconds of decoding: still running when the client leaves
    # abort
    assert load(server, "z", adapter_dirs["a4"]).status_code == 200
    with requests.post(server.url + "/generate", json={"text": "x", "lora_path": "z", "rid": "zz", "stream": True,
                                                       "sampling_params": long}, stream=True, timeout=30) as resp:
        next(line for line in resp.iter_lines() if line.startswith(b"data: "))
        server.post("/abort_request", {"rid": "zz"})
        list(resp.iter_lines())
    timed_unload(server, "z")
    # client disconnect, streaming and not
    assert load(server, "z", adapter_dirs["a4"]).status_code == 200
    with requests.post(server.url + "/generate", json={"text": "x", "lora_path": "z", "stream": True,
                                                       "sampling_params": long}, stream=True, timeout=30) as resp:
        next(line for line in resp.iter_lines() if line.startswith(b"data: "))
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(server.url + "/generate", json={"text": "x", "lora_path": "z", "sampling_params": long},
                      timeout=0.5)
    timed_unload(server, "z")
    # batched native and OpenAI n > 1, streaming
    assert load(server, "z", adapter_dirs["a4"]).status_code == 200
    assert server.post("/generate", {"text": ["a", "b"], "lora_path": ["z", "z"]}).status_code == 200
    with requests.post(server.url + "/v1/completions", json={"model": "z", "prompt": "x", "n": 3, "max_tokens": 8,
                                                             "stream": True}, stream=True, timeout=30) as resp:
        assert [line for line in resp.iter_lines() if line][-1] == b"data: [DONE]"
    timed_unload(server, "z")
    # an unload waits for in-flight requests, refusing new ones at once
    assert load(server, "z", adapter_dirs["a4"]).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(gen, server, "z", "x", sampling_params={"max_new_tokens": 64, "ignore_eos": True})
        time.sleep(0.3)
        unloading = pool.submit(timed_unload, server, "z")
        time.sleep(0.1)
        assert gen(server, "z").status_code == 400
        assert len(running.result().json()["output_ids"]) == 64
        unloading.result()


def test_500_load_unload_cycles_leak_nothing(dynamic_server, adapter_dirs):
    server = dynamic_server

    def rss():
        info = server.get("/server_info").json()
        pids = [server.proc.pid, *info["process_ids"].values()]
        return sum(psutil.Process(p).memory_info().rss for p in pids)

    def cycle(i):
        path = adapter_dirs[("a4", "a16", "a64")[i % 3]]
        assert load(server, "cyc", path).status_code == 200
        if i % 10 == 0:
            assert gen(server, "cyc").status_code == 200
        assert unload(server, "cyc").status_code == 200

    for i in range(30):  # warm-up: allocator pools settle
        cycle(i)
    start_info = server.get("/server_info").json()
    start_rss = rss()
    for i in range(500):
        cycle(i)
    info = server.get("/server_info").json()
    for key in ("num_adapter_entries", "num_adapter_holds", "num_requests_in_flight", "slot_lora_ids", "num_running"):
        assert info[key] == start_info[key], key
    assert all(slot == -1 for slot in info["slot_lora_ids"])
    growth = rss() / start_rss - 1
    assert growth < 0.05, f"memory grew {growth:.1%}"


def test_host_lru_under_max_loaded_loras(llama_dir, adapter_dirs, static_lora_server):
    pinned = json.dumps({"lora_name": "a4", "lora_path": str(adapter_dirs["a4"]), "pinned": True})
    with ServerProcess("--model-path", str(llama_dir), *DYNAMIC_FLAGS, "--max-loaded-loras", "2",
                       "--lora-paths", pinned) as server:
        for name in ("a8", "a16", "a32"):  # past the limit: loads succeed, least recently used host copies go
            assert load(server, name, adapter_dirs[name]).status_code == 200
        table = {a["lora_name"]: a for a in server.get("/lora_adapters").json()["adapters"]}
        assert set(table) == {"a4", "a8", "a16", "a32"}
        assert table["a4"]["pinned"] and table["a4"]["in_host_memory"]  # pinned: never evicted
        assert sum(a["in_host_memory"] for a in table.values()) == 2
        for name in ("a8", "a16", "a32", "a4", "a8"):  # evicted ones are reloaded from their path on use
            expected = gen(static_lora_server, name).json()["output_ids"]
            assert gen(server, name).json()["output_ids"] == expected, name
        assert [c["id"] for c in server.get("/v1/models").json()["data"]][1:] == ["a4", "a8", "a16", "a32"]


def test_dora_with_plain_and_base_in_one_batch_equals_peft(dynamic_server, llama_dir, tmp_path):
    """DoRA adapters loaded at run time serve one /generate batch beside a plain adapter and the base model as HF +
    peft does; an in-place reload swaps one DoRA adapter's magnitudes and norms for another's."""
    server = dynamic_server
    dirs = build_dora_adapters(llama_dir, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    names = [None, "dora", "plain", "dora_qv"]
    for name in names[1:]:
        assert load(server, name, dirs[name]).status_code == 200
    try:

        def expect(served, refs):
            body = {"text": SHARED_PREFIX_PROMPTS, "lora_path": served, "sampling_params": GREEDY}
            resp = server.post("/generate", body)
            assert resp.status_code == 200, resp.text
            compared = sum(assert_greedy_match(out["output_ids"], *hf_greedy(llama_dir, ids, 12, ref), ref or "base")
                           for out, ids, ref in zip(resp.json(), prompt_ids, refs, strict=True))  # fmt: skip
            assert compared >= 12 * len(refs) // 2

        prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in SHARED_PREFIX_PROMPTS]
        expect(names, [None if name is None else dirs[name] for name in names])
        resp = server.post("/v1/load_lora_adapter", {"lora_name": "dora", "lora_path": str(dirs["dora_qv"]),
                                                     "load_inplace": True})
        assert resp.status_code == 200, resp.text
        expect(["dora", None, "plain", "dora"], [dirs["dora_qv"], None, dirs["plain"], dirs["dora_qv"]])
        # a DoRA adapter's norms hold at its own scale: neither a strength nor a mix takes it
        scaled = server.post("/generate", {"text": "Hi", "lora_path": "dora", "lora_scale": 0.5,
                                           "sampling_params": GREEDY})  # fmt: skip
        assert scaled.status_code == 400 and "invalid_lora_scale" in scaled.text and "DoRA" in scaled.text
        mix = {"adapters": {"dora": 0.5, "plain": 0.5}, "merge": "linear"}
        mixed = server.post("/generate", {"text": "Hi", "lora_path": mix, "sampling_params": GREEDY})
        assert mixed.status_code == 400 and "invalid_lora_mix" in mixed.text and "DoRA" in mixed.text
        assert server.post("/generate", {"text": "Hi", "lora_path": "dora", "lora_scale": 1.0,
                                         "sampling_params": GREEDY}).status_code == 200  # fmt: skip
    finally:
        for name in names[1:]:
            unload(server, name)


def test_module_copies_and_trainable_tokens_load_at_run_time_and_equal_peft(dynamic_server, llama_dir, tmp_path):
    """An adapter with full embed_tokens and lm_head copies (modules_to_save) and one with trainable tokens, loaded at
    run time, serve one /generate batch beside a plain adapter and the base model as HF + peft does; unloaded, their
    names are gone."""
    server = dynamic_server
    tokens = [3, 5, 7]
    extras = {"copies": {"modules_to_save": ["lm_head", "embed_tokens"]}, "tokens": {"trainable_token_indices": tokens},
              "plain": {}}  # fmt: skip
    dirs = {}
    for seed, (name, extra) in enumerate(extras.items(), start=81):
        dirs[name] = tmp_path / name
        build_peft_adapter(llama_dir, dirs[name], r=4, lora_alpha=8, target_modules=("q_proj",), seed=seed, **extra)
        assert load(server, name, dirs[name]).status_code == 200
    try:
        tokenizer = AutoTokenizer.from_pretrained(llama_dir)
        prompt_ids = [tokenizer(prompt)["input_ids"][:1] + tokens + tokenizer(prompt)["input_ids"][1:]
                      for prompt in SHARED_PREFIX_PROMPTS]  # fmt: skip
        names = ["copies", None, "tokens", "plain"]
        body = {"input_ids": prompt_ids, "lora_path": names, "sampling_params": GREEDY}
        resp = server.post("/generate", body)
        assert resp.status_code == 200, resp.text
        compared = sum(
            assert_greedy_match(out["output_ids"], *hf_greedy(llama_dir, ids, 12, name and dirs[name]), name or "base")
            for out, ids, name in zip(resp.json(), prompt_ids, names, strict=True)
        )
        assert compared >= 12 * len(names) // 2
    finally:
        for name in extras:
            assert unload(server, name).status_code == 200
    assert gen(server, "copies").status_code == 400
