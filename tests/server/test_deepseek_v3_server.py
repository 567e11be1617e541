"""A DeepSeek-V3-shaped model (latent attention, grouped sigmoid router, shared experts) served end to end with two
adapters on every latent-attention linear and the experts, chunked prefill and the prefix cache: one batch mixing the
base model and both adapters equals HF + peft, cold and from the cache; /server_info reports the latent cache's bytes
per token."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.mla_models import build_mla_set
from tests.reference import assert_greedy_match, hf_greedy
from tests.server_utils import ServerProcess

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
PREFIX = "The morning was cold and clear, and the old farmer walked slowly down the lane. "
PROMPTS = [PREFIX + tail for tail in ("He", "The cows", "Then", "A thin layer of frost")]
NAMES = [None, "a4", "a8", "a4"]


@pytest.fixture(scope="module")
def mla_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_mla_set(tmp_path_factory.mktemp("mla"), with_tokenizer=True)


@pytest.fixture(scope="module")
def server(mla_set):
    model_dir, adapters = mla_set
    lora_paths = [f"{name}={path}" for name, path in adapters.items()]
    with ServerProcess("--model-path", str(model_dir), "--lora-paths", *lora_paths, "--dtype", "float32",
                       "--chunked-prefill-size", "8", "--page-size", "4", "--max-total-tokens", "2048",
                       "--context-length", "256") as server:  # fmt: skip
        yield server


def test_deepseek_v3_mixed_batch_equals_peft_with_chunks_and_prefix_cache(server: ServerProcess, mla_set) -> None:
    model_dir, adapters = mla_set
    info = server.get("/server_info").json()
    assert info["model_type"] == "deepseek_v3" and info["num_hidden_layers"] == 2
    assert info["kv_bytes_per_token"] == 2 * (32 + 8) * 4  # two layers of latent + rope key, fp32
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
    table = {a["lora_name"]: a for a in server.get("/lora_adapters").json()["adapters"]}
    assert table["a8"]["target_modules"] == ["o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
                                             "kv_a_proj_with_mqa", "kv_b_proj"]
