"""The engine core end to end against HF + peft: KV pressure that forces preemption, prompts cut into chunks, and
concurrent requests sharing a prefix across adapters and the base, with the prefix cache on and off."""

from __future__ import annotations

import concurrent.futures

import pytest
from transformers import AutoTokenizer

from tests.reference import assert_greedy_match, hf_greedy
from tests.server_utils import ServerProcess
from tests.unit.test_metrics import parse as parse_metrics
from tests.unit.test_metrics import value as metric

EOS = (2, 4)
MAX_NEW = 10
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
SYSTEM = "You are a helpful assistant who answers in short sentences about the town and the quick brown fox. "
SUFFIXES = ["Hello there", "Once upon a time", "1 2 3 4", "She said that"]
NAMES = [None, "a4", "a16"]
# 24 pages of 4 tokens = 96 tokens of KV: twelve ~40-token requests at once cannot all fit, so some are preempted.
PRESSURE = ("--max-total-tokens", "96", "--page-size", "4", "--chunked-prefill-size", "16",
            "--max-running-requests", "12")


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def run_concurrently(server, cases):
    def one(case):
        prompt, name = case
        resp = server.post("/generate", {"text": prompt, "lora_path": name, "sampling_params": GREEDY})
        assert resp.status_code == 200, resp.text
        return resp.json()["output_ids"]

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(one, cases))


@pytest.mark.parametrize("cache", ["on", "off"])
def test_pressure_chunks_and_shared_prefixes_match_hf(cache, llama_dir, adapter_dirs, tokenizer):
    flags = ["--model-path", str(llama_dir), *PRESSURE, "--lora-paths",
             f"a4={adapter_dirs['a4']}", f"a16={adapter_dirs['a16']}"]
    if cache == "off":
        flags.append("--disable-radix-cache")
    cases = [(SYSTEM + suffix, name) for suffix in SUFFIXES for name in NAMES]
    with ServerProcess(*flags) as server:
        run_concurrently(server, cases[:3])  # warm the cache with the shared prefix under each namespace
        outputs = run_concurrently(server, cases)
        info = server.get("/server_info").json()
        samples = parse_metrics(server.get("/metrics").text)[1]
        assert info["num_requests_in_flight"] == 0 and info["kv_usage"] == 0  # cached pages are not in use
    for (prompt, name), output_ids in zip(cases, outputs, strict=True):
        adapter = None if name is None else adapter_dirs[name]
        ref, margins = hf_greedy(llama_dir, tokenizer(prompt)["input_ids"], MAX_NEW, adapter, eos_token_ids=EOS)
        assert_greedy_match(output_ids, ref, margins, f"cache {cache}, {name}: {prompt}")
    assert info["num_preemptions"] > 0
    hits = metric(samples, "loraplex_prefix_cache_hit_tokens_total")
    assert (hits > 0) == (cache == "on")
    assert metric(samples, "loraplex_prefix_cache_queried_tokens_total") > 0


def test_inplace_reload_never_reuses_the_old_weights_cached_prefix(llama_dir, adapter_dirs, tokenizer):
    prompt = SYSTEM + "Once upon a time"
    with ServerProcess("--model-path", str(llama_dir), "--page-size", "4", "--lora-paths",
                       f"p={adapter_dirs['a4']}", "--max-lora-rank", "64", "--lora-target-modules", "all") as server:
        first = run_concurrently(server, [(prompt, "p")])[0]
        resp = server.post("/v1/load_lora_adapter", {"lora_name": "p", "lora_path": str(adapter_dirs["a16"]),
                                                     "load_inplace": True})
        assert resp.status_code == 200, resp.text
        second = run_concurrently(server, [(prompt, "p")])[0]
    ids = tokenizer(prompt)["input_ids"]
    for output_ids, adapter in ((first, "a4"), (second, "a16")):
        ref, margins = hf_greedy(llama_dir, ids, MAX_NEW, adapter_dirs[adapter], eos_token_ids=EOS)
        assert_greedy_match(output_ids, ref, margins, f"after reload, {adapter}")
    assert first != second
