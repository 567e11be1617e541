"""Host-memory eviction (--max-loaded-loras) under load: an eviction never fails a request that raced it, and a
batch never evicts the adapters it needs itself."""

from __future__ import annotations

import concurrent.futures
import itertools
import threading

import pytest
from transformers import AutoTokenizer

from tests.reference import CLEAR_MARGIN, assert_greedy_match, hf_greedy
from tests.server_utils import ServerProcess, fault_env
from tests.unit.test_metrics import parse as parse_metrics
from tests.unit.test_metrics import value as metric

# vLLM's spellings: 2 device slots, 3 host copies.
CHURN_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-cpu-loras", "3", "--max-lora-rank", "64",
               "--lora-target-modules", "all", "--max-total-tokens", "8192", "--context-length", "512")
PROMPTS = ["Once upon a time", "The cat sat"]  # every adapter's first 5 greedy tokens have a clear top-1 margin
MAX_TOKENS = 5
EOS_TOKEN_IDS = (2, 4)
# Each forward pass takes 20 ms more, as under real load: a drop waits for the pass in flight, so the window in which
# a request can race an eviction is wide enough to be hit on every run.
SLOW_STEPS = fault_env(stall_forward_on_rank=0, stall_forward_s=0.02)


def reload_count(server) -> float:
    samples = parse_metrics(server.get("/metrics").text)[1]
    return metric(samples, "loraplex_adapter_operations_total", op="reload", result="success")


def no_leaks(server) -> None:
    info = server.get("/server_info").json()
    assert info["num_requests_in_flight"] == 0 and info["num_adapter_holds"] == 0, info


@pytest.fixture(scope="module")
def expected_texts(llama_dir, adapter_dirs) -> dict[str, list[str]]:
    """peft's greedy text of each prompt under each test adapter (only where every token is a clear choice)."""
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    texts = {}
    for name, path in adapter_dirs.items():
        texts[name] = []
        for prompt in PROMPTS:
            ref, margins = hf_greedy(llama_dir, tokenizer(prompt)["input_ids"], MAX_TOKENS, path, EOS_TOKEN_IDS)
            assert min(margins) > CLEAR_MARGIN, (name, prompt, margins)  # else an exact comparison could not hold
            texts[name].append(tokenizer.decode(ref, skip_special_tokens=True))
    return texts


def test_host_churn_never_fails_a_request_and_outputs_equal_peft(llama_dir, adapter_dirs, expected_texts):
    """8 adapters loaded concurrently while requests run, then load-and-request rounds, all past the host limit of 3:
    every eviction races requests for its victim. Each one must answer 200 with peft's text (or reload first)."""
    dirs = list(adapter_dirs)
    dir_of = {f"n{i}": dirs[i % len(dirs)] for i in range(100)} | {"last": dirs[0]}
    loaded: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    results: list[tuple[str, int, object]] = []  # (adapter, status, choices or error body)

    with ServerProcess("--model-path", str(llama_dir), *CHURN_FLAGS, env=SLOW_STEPS) as server:
        def load(name: str) -> None:
            resp = server.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dirs[dir_of[name]])})
            assert resp.status_code == 200, resp.text
            with lock:
                loaded.append(name)

        def complete(name: str) -> None:
            resp = server.post("/v1/completions", {"model": name, "prompt": PROMPTS, "max_tokens": MAX_TOKENS,
                                                   "temperature": 0})
            body = resp.json()
            outcome = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])] if resp.ok else body
            with lock:
                results.append((name, resp.status_code, outcome))

        turns = itertools.count()

        def requester() -> None:
            # One cyclic order over the 5 newest adapters, 2 more than the host holds: the least recently used copy,
            # which the next eviction drops, is always among the next ones asked for, so requests race evictions.
            while not stop.is_set():
                with lock:
                    recent = loaded[-5:]
                    name = recent[next(turns) % len(recent)]
                complete(name)

        load("n0")
        with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
            workers = [pool.submit(requester) for _ in range(4)]
            list(pool.map(load, [f"n{i}" for i in range(1, 8)]))  # 7 concurrent loads while requests run
            for i in itertools.count(8):  # rounds: load one more past the limit, ask for it at once
                if len(results) >= 200 or f"n{i}" not in dir_of:
                    break
                load(f"n{i}")
                complete(f"n{i}")
            stop.set()
            for worker in workers:
                worker.result()

        failures = [(name, status, outcome) for name, status, outcome in results if status != 200]
        assert not failures, f"{len(failures)} of {len(results)} requests failed, e.g. {failures[:3]}"
        assert len(results) >= 200
        for name, _, texts in results:
            assert texts == expected_texts[dir_of[name]], name
        # While every candidate was held, eviction waited: the next load, with all idle, trims back to the limit.
        load("last")
        rows = server.get("/lora_adapters").json()["adapters"]
        assert sum(row["in_host_memory"] for row in rows) == 3
        assert reload_count(server) > 20  # the churn really went through evictions and reloads
        no_leaks(server)


def test_a_batch_never_evicts_the_adapters_it_needs(llama_dir, adapter_dirs):
    """--max-loaded-loras 2, x evicted: a batch alternating y and x reloads x once and keeps y; a batch that needs more
    adapters than the host limit is refused up front (400), and starts nothing."""
    flags = ("--enable-lora", "--max-loaded-loras", "2", "--max-loras-per-batch", "4", "--max-lora-rank", "64",
             "--lora-target-modules", "all", "--max-total-tokens", "8192", "--context-length", "512")
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    prompt_ids = tokenizer(PROMPTS[0])["input_ids"]
    with ServerProcess("--model-path", str(llama_dir), *flags) as server:
        for name, path in (("x", "a4"), ("y", "a8"), ("z", "a16")):
            assert server.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dirs[path])}).ok
        rows = {row["lora_name"]: row for row in server.get("/lora_adapters").json()["adapters"]}
        assert not rows["x"]["in_host_memory"] and rows["y"]["in_host_memory"]  # x: least recently loaded

        names = ["y", "x"] * 5
        resp = server.post("/generate", {"text": [PROMPTS[0]] * len(names), "lora_path": names,
                                         "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}})
        assert resp.status_code == 200, resp.text
        for name, item in zip(names, resp.json(), strict=True):
            ref, margins = hf_greedy(llama_dir, prompt_ids, MAX_TOKENS, adapter_dirs[{"x": "a4", "y": "a8"}[name]],
                                     EOS_TOKEN_IDS)
            assert_greedy_match(item["output_ids"], ref, margins, name)
        assert reload_count(server) == 1  # x, once; y stayed
        rows = {row["lora_name"]: row for row in server.get("/lora_adapters").json()["adapters"]}
        assert rows["x"]["in_host_memory"] and rows["y"]["in_host_memory"] and not rows["z"]["in_host_memory"]

        resp = server.post("/generate", {"text": [PROMPTS[0]] * 3, "lora_path": ["x", "y", "z"],
                                         "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}})
        assert resp.status_code == 400, resp.text
        assert "--max-loaded-loras" in resp.text and "3" in resp.text
        assert reload_count(server) == 1  # refused before any reload
        resp = server.post("/generate", {"text": [PROMPTS[0]] * 3, "lora_path": ["x", None, "x"],
                                         "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}})
        assert resp.status_code == 200, resp.text  # the base model counts for nothing
        no_leaks(server)
