"""A Gemma-4-shaped model (wider full-attention heads whose values are their keys, KV-shared layers, double-wide MLPs,
per-layer inputs, a sliding window) served end to end with two adapters (attention only; attention and MLPs),
chunked prefill and the prefix cache: one batch mixing the base model and both adapters equals HF + peft, cold and
from the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gemma4_models import build_gemma4_set
from tests.reference import assert_mixed_batch_equals_peft
from tests.server_utils import CHUNKED_ARGS, ServerProcess

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
NAMES = [None, "a4", "a8", "a4"]


@pytest.fixture(scope="module")
def gemma4_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_gemma4_set(tmp_path_factory.mktemp("gemma4"), "dense", with_tokenizer=True)


@pytest.fixture(scope="module")
def server(gemma4_set):
    model_dir, adapters = gemma4_set
    lora_paths = [f"{name}={path}" for name, path in adapters.items()]
    with ServerProcess("--model-path", str(model_dir), "--lora-paths", *lora_paths, "--dtype", "float32",
                       *CHUNKED_ARGS) as server:  # fmt: skip
        yield server


def test_gemma4_mixed_batch_equals_peft_with_chunks_and_prefix_cache(server: ServerProcess, gemma4_set) -> None:
    model_dir, adapters = gemma4_set
    info = server.get("/server_info").json()
    assert info["model_type"] == "gemma4_text" and info["num_hidden_layers"] == 5
    assert_mixed_batch_equals_peft(server, model_dir, adapters, NAMES, GREEDY)
