"""A Qwen3 model served end to end at TP=2 with two adapters, chunked prefill and the prefix cache: one batch mixing
the base model and both adapters equals HF + peft, and again when the prompts' prefixes come from the cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.reference import assert_greedy_match, hf_greedy
from tests.server_utils import ServerProcess

EOS = (2, 4)
MAX_NEW = 10
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
PREFIX = "The morning was cold and clear, and the old farmer walked slowly down the lane. "
PROMPTS = [PREFIX + tail for tail in ("He", "The cows", "Then", "A thin layer of frost")]
NAMES = [None, "q8", "q16", "q8"]


@pytest.fixture(scope="module")
def server(qwen3_dir: Path, qwen3_adapter_dirs: dict[str, Path]):
    lora_paths = [f"{name}={path}" for name, path in qwen3_adapter_dirs.items()]
    with ServerProcess("--model-path", str(qwen3_dir), "--tp", "2", "--lora-paths", *lora_paths,
                       "--chunked-prefill-size", "8", "--page-size", "4", "--max-total-tokens", "2048",
                       "--context-length", "256") as server:  # fmt: skip
        yield server


def test_qwen3_mixed_batch_equals_peft_with_chunks_and_prefix_cache(
    server: ServerProcess, qwen3_dir: Path, qwen3_adapter_dirs: dict[str, Path]
) -> None:
    info = server.get("/server_info").json()
    assert info["model_type"] == "qwen3" and info["num_hidden_layers"] == 2
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    refs = []
    for prompt, name in zip(PROMPTS, NAMES, strict=True):
        adapter = None if name is None else qwen3_adapter_dirs[name]
        refs.append(hf_greedy(qwen3_dir, tokenizer(prompt)["input_ids"], MAX_NEW, adapter, eos_token_ids=EOS))
    assert len(tokenizer(PREFIX)["input_ids"]) > 8  # each prompt takes more than one chunk of 8
    for attempt in ("cold", "cached"):
        resp = server.post("/generate", {"text": PROMPTS, "lora_path": NAMES, "sampling_params": GREEDY})
        assert resp.status_code == 200, resp.text
        num_compared = sum(assert_greedy_match(out["output_ids"], ref, margins, f"{attempt} {name or 'base'}")
                           for out, (ref, margins), name in zip(resp.json(), refs, NAMES, strict=True))  # fmt: skip
        assert num_compared >= MAX_NEW * len(PROMPTS) // 2  # most steps had a clear margin
    assert "model_type qwen3, 2 hidden layers, load format auto" in server.log()
    # The second round (and the batch's later rows with one adapter) found their prefix in the cache.
    assert server.get("/server_info").json()["prefix_cache_hit_tokens"] > 0
