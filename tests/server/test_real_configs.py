"""Every shipped real config.json (tests/data/model_configs/<model>/) starts a server with `--load-format dummy` and
`--hf-overrides '{"num_hidden_layers": 2}'`, at the model's real widths and vocabulary in bfloat16, and answers a
request. One server at a time: an 8B model's embedding and head alone are ~2 GB in bfloat16."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig

from tests.builders import build_tokenizer
from tests.server_utils import ServerProcess

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "data" / "model_configs"
# the quantized ones start in test_quantized_real_configs.py, with an adapter and their weights' size checked
MODELS = sorted(path.parent.name for path in CONFIGS_DIR.glob("*/config.json")
                if "quantization_config" not in json.loads(path.read_text()))
MAX_NEW = 4


def test_the_dense_configs_are_shipped() -> None:
    assert {"Llama-3.1-8B", "Qwen3-8B", "Mistral-7B-v0.3", "Qwen2.5-7B"} <= set(MODELS)


@pytest.mark.parametrize("model", MODELS)
def test_real_config_serves_with_dummy_weights_and_two_layers(model: str, tmp_path: Path) -> None:
    # The shipped directory holds config.json only (no weights); the server also needs a tokenizer: the tests' tiny
    # one, whose ids are all inside every real vocabulary.
    model_dir = tmp_path / model
    model_dir.mkdir()
    shutil.copy(CONFIGS_DIR / model / "config.json", model_dir / "config.json")
    build_tokenizer(model_dir)
    real = json.loads((model_dir / "config.json").read_text())
    # as transformers reads it (a multimodal config's language model: Gemma 3's text_config, its defaults filled in)
    vocab_size = AutoConfig.from_pretrained(model_dir).get_text_config().vocab_size
    # torch ops: what is tested here is the config, the overrides and the dummy weights at real shapes, so no server
    # waits for the CPU kernels' build (tests/compute/test_cpu_kernels_worker.py covers those).
    with ServerProcess("--model-path", str(model_dir), "--load-format", "dummy", "--hf-overrides",
                       '{"num_hidden_layers": 2}', "--dtype", "bfloat16", "--context-length", "128",
                       "--max-total-tokens", "512", "--max-running-requests", "4", "--lora-backend", "torch",
                       "--attention-backend", "torch", start_timeout_s=600) as server:  # fmt: skip
        info = server.get("/server_info").json()
        assert (info["model_type"], info["num_hidden_layers"], info["load_format"]) == (real["model_type"], 2, "dummy")
        assert info["vocab_size"] == vocab_size and info["hf_overrides"] == {"num_hidden_layers": 2}
        sampling = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        resp = server.post("/generate", {"text": "The morning was cold", "sampling_params": sampling})
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert len(out["output_ids"]) == MAX_NEW and all(0 <= t < vocab_size for t in out["output_ids"])
        log = server.log()
    assert f"model_type {real['model_type']}, 2 hidden layers, load format dummy" in log
