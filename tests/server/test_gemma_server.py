"""A Gemma 3 text model served end to end with two adapters, chunked prefill and the prefix cache on: prompts of 3x
the sliding window, base and adapters in one batch, each equal to HF + peft."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.builders import build_lora_adapter, build_tokenizer, tokenizer_vocab_size
from tests.gemma_helpers import WINDOW, build_tiny_gemma
from tests.reference import assert_greedy_match, hf_greedy
from tests.server_utils import ServerProcess
from tests.worker_helpers import random_prompts

MAX_NEW = 6
NAMES = [None, "a", "b", "a"]


@pytest.fixture(scope="module")
def gemma_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("gemma_server")
    model_dir = root / "gemma3"
    build_tiny_gemma(model_dir, "gemma3_text", vocab_size=tokenizer_vocab_size(), bos_token_id=1, eos_token_id=2)
    build_tokenizer(model_dir)
    adapters = {}
    for seed, (name, targets) in enumerate((("a", ("q_proj", "v_proj", "down_proj")),
                                            ("b", ("k_proj", "o_proj", "gate_proj", "up_proj"))), start=1):  # fmt: skip
        adapters[name] = root / name
        build_lora_adapter(model_dir, adapters[name], r=8, lora_alpha=16, target_modules=targets, seed=seed)
    return model_dir, adapters


def test_gemma_server_matches_hf_past_the_window(gemma_model: tuple[Path, dict[str, Path]]) -> None:
    model_dir, adapters = gemma_model
    lora_paths = [f"{name}={path}" for name, path in adapters.items()]
    # Prompts share a first window's worth of tokens, so later ones hit the prefix cache; chunks of 16 tokens.
    shared, *tails = random_prompts([WINDOW + 4, 2 * WINDOW, 3 * WINDOW, 2 * WINDOW + 3, 3 * WINDOW + 1],
                                    tokenizer_vocab_size() - 10, seed=8)  # fmt: skip
    prompts = [[t + 10 for t in shared + tail] for tail in tails]  # clear of the special tokens
    sampling = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    with ServerProcess("--model-path", str(model_dir), "--lora-paths", *lora_paths, "--max-loras-per-batch", "2",
                       "--chunked-prefill-size", "16", "--page-size", "4", "--max-total-tokens", "2048",
                       "--context-length", "256") as server:  # fmt: skip
        first = server.post("/generate", {"input_ids": prompts[0], "lora_path": NAMES[0], "sampling_params": sampling})
        assert first.status_code == 200, first.text
        resp = server.post("/generate", {"input_ids": prompts, "lora_path": NAMES, "sampling_params": sampling})
        assert resp.status_code == 200, resp.text
        outputs = [out["output_ids"] for out in resp.json()]
        hit_tokens = server.get("/server_info").json()["prefix_cache_hit_tokens"]
    assert first.json()["output_ids"] == outputs[0]
    assert hit_tokens >= WINDOW, hit_tokens  # the prefix cache served part of the prompts
    for prompt, name, out in zip(prompts, NAMES, outputs, strict=True):
        ref, margins = hf_greedy(model_dir, prompt, MAX_NEW, None if name is None else adapters[name])
        assert assert_greedy_match(out, ref, margins, what=name or "base") >= MAX_NEW // 2
