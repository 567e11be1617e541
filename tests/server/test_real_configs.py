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
# the quantized ones start in test_quantized_real_configs.py, with an adapter and their weights' size checked; those
# that take images (an image processor beside: preprocessor_config.json) in their family's server test, with an image
MODELS = sorted(path.parent.name for path in CONFIGS_DIR.glob("*/config.json")
                if "quantization_config" not in json.loads(path.read_text())
                and not (path.parent / "preprocessor_config.json").exists())
MAX_NEW = 4
# Checkpoints served with their vision tower: the tower cut to one layer, and an image request answered too
VISION_OVERRIDES = {"gemma4": {"vision_config": {"num_hidden_layers": 1}}}


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
    vision = VISION_OVERRIDES.get(json.loads((model_dir / "config.json").read_text())["model_type"])
    if vision is not None:
        write_image_processor(model_dir)
    serves_with_dummy_weights(model_dir, {"num_hidden_layers": 2, **(vision or {})}, image=vision is not None)


def test_glm_4_5_air_shape_serves_with_dummy_weights_and_fewer_layers_and_experts(tmp_path: Path) -> None:
    """GLM-4.5-Air's shape, which no config.json here records: transformers' Glm4MoeConfig defaults (46 layers,
    hidden 4096, 96 q / 8 KV heads, 128 routed experts of 1408 with top 8, one shared expert, the first layer dense,
    vocabulary 151552, partial rotary 0.5), with what they leave out of Air's shape as slime's (THUDM's training
    framework) scripts/models/glm4.5-106B-A12B.sh states it: head_dim 128 (kv-channels), q/k/v biases (add-qkv-bias),
    rope theta 1e6 (rotary-base). Not the published config.json. Cut to 2 layers (1 dense, 1 MoE) and 16 experts by
    --hf-overrides."""
    from transformers import Glm4MoeConfig

    model_dir = tmp_path / "glm-4.5-air-shape"
    model_dir.mkdir()
    config = Glm4MoeConfig(head_dim=128, attention_bias=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
    (model_dir / "config.json").write_text(json.dumps(config.to_dict()))
    build_tokenizer(model_dir)
    serves_with_dummy_weights(model_dir, {"num_hidden_layers": 2, "n_routed_experts": 16})


def write_image_processor(model_dir: Path) -> None:
    """Gemma 4's image processor at its real patch and pooling sizes and its smallest budget (70 soft tokens)."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    Gemma4ImageProcessorPil(max_soft_tokens=70).save_pretrained(model_dir)


def serves_with_dummy_weights(model_dir: Path, overrides: dict, image: bool = False) -> None:
    """model_dir (its config.json and the tests' tokenizer) starts with dummy weights and `overrides`, and answers;
    with `image`, /generate's token ids with the config's image token and image_data (a data: URL) too."""
    real = json.loads((model_dir / "config.json").read_text())
    # as transformers reads it (a multimodal config's language model: Gemma 3's text_config, its defaults filled in)
    vocab_size = AutoConfig.from_pretrained(model_dir).get_text_config().vocab_size
    # torch ops: what is tested here is the config, the overrides and the dummy weights at real shapes, so no server
    # waits for the CPU kernels' build (tests/compute/test_cpu_kernels_worker.py covers those).
    with ServerProcess("--model-path", str(model_dir), "--load-format", "dummy", "--hf-overrides",
                       json.dumps(overrides), "--dtype", "bfloat16", "--context-length", "128",
                       "--max-total-tokens", "512", "--max-running-requests", "4", "--lora-backend", "torch",
                       "--attention-backend", "torch", start_timeout_s=600) as server:  # fmt: skip
        info = server.get("/server_info").json()
        assert (info["model_type"], info["num_hidden_layers"], info["load_format"]) == (real["model_type"], 2, "dummy")
        assert info["vocab_size"] == vocab_size and info["hf_overrides"] == overrides
        sampling = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        resp = server.post("/generate", {"text": "The morning was cold", "sampling_params": sampling})
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert len(out["output_ids"]) == MAX_NEW and all(0 <= t < vocab_size for t in out["output_ids"])
        if image:
            from tests.image_inputs import GOOD_PNG, data_url

            ids = [real.get("bos_token_id") or 2, 100, real["image_token_id"], 101]
            resp = server.post("/generate", {"input_ids": ids, "image_data": data_url(GOOD_PNG),
                                             "sampling_params": sampling})  # fmt: skip
            assert resp.status_code == 200, resp.text
            out = resp.json()
            assert len(out["output_ids"]) == MAX_NEW and out["meta_info"]["prompt_tokens"] > len(ids) + 2
        log = server.log()
    assert f"model_type {real['model_type']}, 2 hidden layers, load format dummy" in log
