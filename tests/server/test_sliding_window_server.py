"""A sliding-window Mistral served end to end: requests several windows long, equal to HF, in a KV cache too small to
hold them all whole: they fit without preemption only because each gives back the pages behind its window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from tests.builders import build_tokenizer, tokenizer_vocab_size
from tests.reference import assert_greedy_match, hf_greedy
from tests.server_utils import ServerProcess
from tests.worker_helpers import TINY_LLAMA, random_prompts

WINDOW, PAGE_SIZE, KV_TOKENS = 6, 4, 128
PROMPT_LEN, MAX_NEW, NUM_REQS = 30, 20, 4


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mistral_window_server")
    config = MistralConfig(**{**TINY_LLAMA, "vocab_size": tokenizer_vocab_size()}, sliding_window=WINDOW)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            values = torch.randn(param.shape, generator=generator) * 0.3
            param.copy_(torch.ones_like(param) if name.endswith("norm.weight") else values)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    return path


def test_windowed_requests_share_a_small_cache_and_match_hf(mistral_dir: Path) -> None:
    # Whole, the requests need NUM_REQS * 13 pages of the cache's 32; behind their windows, about 5 each.
    assert NUM_REQS * -(-(PROMPT_LEN + MAX_NEW) // PAGE_SIZE) > KV_TOKENS // PAGE_SIZE
    prompts = [[t + 10 for t in p] for p in random_prompts([PROMPT_LEN] * NUM_REQS, tokenizer_vocab_size() - 10,
                                                           seed=6)]  # fmt: skip
    sampling = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    with ServerProcess("--model-path", str(mistral_dir), "--page-size", str(PAGE_SIZE), "--max-total-tokens",
                       str(KV_TOKENS), "--chunked-prefill-size", "8", "--context-length", "256") as server:  # fmt: skip
        resp = server.post("/generate", {"input_ids": prompts, "sampling_params": sampling})
        assert resp.status_code == 200, resp.text
        info = server.get("/server_info").json()
    assert info["num_preemptions"] == 0, info
    for prompt, out in zip(prompts, resp.json(), strict=True):
        ref, margins = hf_greedy(mistral_dir, prompt, MAX_NEW)
        assert assert_greedy_match(out["output_ids"], ref, margins, what="windowed") >= MAX_NEW // 2
