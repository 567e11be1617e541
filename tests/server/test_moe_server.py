"""A Mixtral-shaped model served end to end at TP=2 with expert parallelism (--enable-expert-parallel: each rank holds
half of the experts whole; worker/layers/expert_parallel.py) with two expert adapters (PEFT's per-expert and
target_parameters forms), chunked prefill and the prefix cache: one batch mixing the base model and both adapters
equals HF + peft, and again when the prompts' prefixes come from the cache. (TP=2 with experts sharded by rows is
checked against TP=1 in tests/process/test_moe_tp.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.moe_models import build_moe_set
from tests.reference import assert_mixed_batch_equals_peft
from tests.server_utils import CHUNKED_ARGS, ServerProcess

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
NAMES = [None, "a4", "a8", "a4"]


@pytest.fixture(scope="module")
def moe_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_moe_set(tmp_path_factory.mktemp("moe"), "mixtral", with_tokenizer=True)


@pytest.fixture(scope="module")
def server(moe_set):
    model_dir, adapters = moe_set
    lora_paths = [f"{name}={path}" for name, path in adapters.items()]
    with ServerProcess("--model-path", str(model_dir), "--tp", "2", "--enable-expert-parallel",
                       "--lora-paths", *lora_paths, *CHUNKED_ARGS) as server:  # fmt: skip
        yield server


def test_mixtral_mixed_batch_equals_peft_with_chunks_and_prefix_cache(server: ServerProcess, moe_set) -> None:
    model_dir, adapters = moe_set
    info = server.get("/server_info").json()
    assert info["model_type"] == "mixtral" and info["num_hidden_layers"] == 3
    assert info["enable_expert_parallel"] and info["tp"] == 2
    assert_mixed_batch_equals_peft(server, model_dir, adapters, NAMES, GREEDY)
    # the adapters' expert targets as the server reports them
    table = {a["lora_name"]: a for a in server.get("/lora_adapters").json()["adapters"]}
    assert table["a8"]["target_modules"] == ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
