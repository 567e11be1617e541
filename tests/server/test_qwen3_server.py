"""A Qwen3 model served end to end at TP=2 with two adapters, chunked prefill and the prefix cache: one batch mixing
the base model and both adapters equals HF + peft, and again when the prompts' prefixes come from the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reference import assert_mixed_batch_equals_peft
from tests.server_utils import CHUNKED_ARGS, ServerProcess

EOS = (2, 4)
MAX_NEW = 10
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
NAMES = [None, "q8", "q16", "q8"]


@pytest.fixture(scope="module")
def server(qwen3_dir: Path, qwen3_adapter_dirs: dict[str, Path]):
    lora_paths = [f"{name}={path}" for name, path in qwen3_adapter_dirs.items()]
    with ServerProcess("--model-path", str(qwen3_dir), "--tp", "2", "--lora-paths", *lora_paths,
                       *CHUNKED_ARGS) as server:
        yield server


def test_qwen3_mixed_batch_equals_peft_with_chunks_and_prefix_cache(
    server: ServerProcess, qwen3_dir: Path, qwen3_adapter_dirs: dict[str, Path]
) -> None:
    info = server.get("/server_info").json()
    assert info["model_type"] == "qwen3" and info["num_hidden_layers"] == 2
    assert_mixed_batch_equals_peft(server, qwen3_dir, qwen3_adapter_dirs, NAMES, GREEDY, eos_token_ids=EOS)
    assert "model_type qwen3, 2 hidden layers, load format auto" in server.log()
