"""A Mixtral-shaped model served end to end at TP=2 with two expert adapters (PEFT's per-expert and target_parameters
forms), chunked prefill and the prefix cache: one batch mixing the base model and both adapters equals HF + peft,
and again when the prompts' prefixes come from the cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.moe_models import build_moe_set
from tests.reference import assert_greedy_match, hf_greedy
from tests.server_utils import ServerProcess

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
PREFIX = "The morning was cold and clear, and the old farmer walked slowly down the lane. "
PROMPTS = [PREFIX + tail for tail in ("He", "The cows", "Then", "A thin layer of frost")]
NAMES = [None, "a4", "a8", "a4"]


@pytest.fixture(scope="module")
def moe_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_moe_set(tmp_path_factory.mktemp("moe"), "mixtral", with_tokenizer=True)


@pytest.fixture(scope="module")
def server(moe_set):
    model_dir, adapters = moe_set
    lora_paths = [f"{name}={path}" for name, path in adapters.items()]
    with ServerProcess("--model-path", str(model_dir), "--tp", "2", "--lora-paths", *lora_paths,
                       "--chunked-prefill-size", "8", "--page-size", "4", "--max-total-tokens", "2048",
                       "--context-length", "256") as server:  # fmt: skip
        yield server


def test_mixtral_mixed_batch_equals_peft_with_chunks_and_prefix_cache(server: ServerProcess, moe_set) -> None:
    model_dir, adapters = moe_set
    info = server.get("/server_info").json()
    assert info["model_type"] == "mixtral" and info["num_hidden_layers"] == 3
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    refs = [hf_greedy(model_dir, tokenizer(prompt)["input_ids"], MAX_NEW, None if name is None else adapters[name])
            for prompt, name in zip(PROMPTS, NAMES, strict=True)]  # fmt: skip
    assert len(tokenizer(PREFIX)["input_ids"]) > 8  # each prompt takes more than one chunk of 8
    for attempt in ("cold", "cached"):
        resp = server.post("/generate", {"text": PROMPTS, "lora_path": NAMES, "sampling_params": GREEDY})
        assert resp.status_code == 200, resp.text
        num_compared = sum(assert_greedy_match(out["output_ids"], ref, margins, f"{attempt} {name or 'base'}")
                           for out, (ref, margins), name in zip(resp.json(), refs, NAMES, strict=True))  # fmt: skip
        assert num_compared >= MAX_NEW * len(PROMPTS) // 2  # most steps had a clear margin
    assert server.get("/server_info").json()["prefix_cache_hit_tokens"] > 0
    # the adapters' expert targets as the server reports them
    table = {a["lora_name"]: a for a in server.get("/lora_adapters").json()["adapters"]}
    assert table["a8"]["target_modules"] == ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
