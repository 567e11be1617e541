"""A DeepSeek-V3-shaped model (latent attention, grouped sigmoid router, shared experts) served end to end with two
adapters on every latent-attention linear and the experts, chunked prefill and the prefix cache: one batch mixing the
base model and both adapters equals HF + peft, cold and from the cache; /server_info reports the latent cache's bytes
per token."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mla_models import build_mla_set
from tests.reference import assert_mixed_batch_equals_peft
from tests.server_utils import CHUNKED_ARGS, ServerProcess

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
NAMES = [None, "a4", "a8", "a4"]


@pytest.fixture(scope="module")
def mla_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_mla_set(tmp_path_factory.mktemp("mla"), with_tokenizer=True)


@pytest.fixture(scope="module")
def server(mla_set):
    model_dir, adapters = mla_set
    lora_paths = [f"{name}={path}" for name, path in adapters.items()]
    with ServerProcess("--model-path", str(model_dir), "--lora-paths", *lora_paths, "--dtype", "float32",
                       *CHUNKED_ARGS) as server:
        yield server


def test_deepseek_v3_mixed_batch_equals_peft_with_chunks_and_prefix_cache(server: ServerProcess, mla_set) -> None:
    model_dir, adapters = mla_set
    info = server.get("/server_info").json()
    assert info["model_type"] == "deepseek_v3" and info["num_hidden_layers"] == 2
    assert info["kv_bytes_per_token"] == 2 * (32 + 8) * 4  # two layers of latent + rope key, fp32
    assert_mixed_batch_equals_peft(server, model_dir, adapters, NAMES, GREEDY)
    table = {a["lora_name"]: a for a in server.get("/lora_adapters").json()["adapters"]}
    assert table["a8"]["target_modules"] == ["o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
                                             "kv_a_proj_with_mqa", "kv_b_proj"]
