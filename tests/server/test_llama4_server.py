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


def test_an_image_on_the_text_model_is_a_400(server: ServerProcess) -> None:
    """llama4_text takes no images: a chat image part is refused by name, and nothing is left in flight."""
    from tests.image_inputs import GOOD_PNG, data_url

    model = server.get("/v1/models").json()["data"][0]["id"]
    content = [{"type": "image_url", "image_url": {"url": data_url(GOOD_PNG)}}, {"type": "text", "text": "what?"}]
    resp = server.post("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": content}]})
    assert resp.status_code == 400, resp.text
    assert "takes no images" in resp.json()["error"]["message"]
    assert server.get("/server_info").json()["num_requests_in_flight"] == 0
