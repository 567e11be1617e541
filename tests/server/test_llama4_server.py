"""A Llama-4-shaped model (chunked local attention, a NoPE layer, sigmoid top-1 experts with a shared expert, dense
layers between) served end to end with two adapters (attention only; attention, MLPs, shared and stacked experts),
chunked prefill and the prefix cache: one batch mixing the base model and both adapters equals HF + peft, cold and
from the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.llama4_models import build_llama4_set
from tests.reference import assert_mixed_batch_equals_peft
from tests.server_utils import CHUNKED_ARGS, ServerProcess

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
NAMES = [None, "a4", "a8", "a4"]


@pytest.fixture(scope="module")
def llama4_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_llama4_set(tmp_path_factory.mktemp("llama4"), with_tokenizer=True)


@pytest.fixture(scope="module")
def server(llama4_set):
    model_dir, adapters = llama4_set
    lora_paths = [f"{name}={path}" for name, path in adapters.items()]
    with ServerProcess("--model-path", str(model_dir), "--lora-paths", *lora_paths, "--dtype", "float32",
                       *CHUNKED_ARGS) as server:  # fmt: skip
        yield server


def test_llama4_mixed_batch_equals_peft_with_chunks_and_prefix_cache(server: ServerProcess, llama4_set) -> None:
    model_dir, adapters = llama4_set
    info = server.get("/server_info").json()
    assert info["model_type"] == "llama4_text" and info["num_hidden_layers"] == 4
    assert_mixed_batch_equals_peft(server, model_dir, adapters, NAMES, GREEDY)
