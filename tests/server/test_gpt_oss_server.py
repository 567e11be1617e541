"""gpt-oss served end to end. A tiny model with its experts in MXFP4 (as the published checkpoints store them) and two
adapters (attention alone; attention and every expert), chunked prefill and the prefix cache: one batch mixing the
base model and both adapters equals HF + peft on the same weights dequantized, cold and from the cache. And
gpt-oss's widths (transformers' GptOssConfig defaults, MXFP4 experts) start with `--load-format dummy` and
`--hf-overrides` shrinking layers and experts, answer, and hold the experts at MXFP4's size."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.builders import build_tokenizer
from tests.gpt_oss_models import build_gpt_oss_set
from tests.mxfp4_checkpoint import QUANTIZATION_CONFIG, write_mxfp4
from tests.reference import assert_mixed_batch_equals_peft
from tests.server_utils import CHUNKED_ARGS, ServerProcess

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
NAMES = [None, "a4", "a8", "a8"]


@pytest.fixture(scope="module")
def mxfp4_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("gpt_oss")
    model_dir, adapters = build_gpt_oss_set(root, with_tokenizer=True)
    write_mxfp4(model_dir, root / "mxfp4", root / "dequantized")
    return root / "mxfp4", root / "dequantized", adapters


def test_mxfp4_mixed_batch_equals_peft_on_the_dequantized_weights(mxfp4_set) -> None:
    quant_dir, dequant_dir, adapters = mxfp4_set
    lora_paths = [f"{name}={path}" for name, path in adapters.items()]
    with ServerProcess("--model-path", str(quant_dir), "--lora-paths", *lora_paths, *CHUNKED_ARGS) as server:
        info = server.get("/server_info").json()
        assert (info["model_type"], info["num_hidden_layers"]) == ("gpt_oss", 3)
        assert_mixed_batch_equals_peft(server, dequant_dir, adapters, NAMES, GREEDY)
        assert "quantization: mxfp4" in server.log()


def gpt_oss_defaults_config() -> dict:
    """transformers' GptOssConfig defaults (not a published config.json) with the published checkpoints' MXFP4
    quantization_config."""
    from transformers import GptOssConfig

    config = GptOssConfig().to_dict()
    config.update(architectures=["GptOssForCausalLM"], dtype="bfloat16", quantization_config=QUANTIZATION_CONFIG)
    return config


def test_gpt_oss_widths_serve_with_dummy_mxfp4_experts(tmp_path: Path) -> None:
    model_dir = tmp_path / "gpt-oss"
    model_dir.mkdir()
    config = gpt_oss_defaults_config()
    assert (config["hidden_size"], config["intermediate_size"], config["vocab_size"]) == (2880, 2880, 201088)
    (model_dir / "config.json").write_text(json.dumps(config))
    build_tokenizer(model_dir)
    overrides = json.dumps({"num_hidden_layers": 2, "num_local_experts": 4})  # layer_types: its first two are kept
    with ServerProcess("--model-path", str(model_dir), "--load-format", "dummy", "--hf-overrides", overrides,
                       "--dtype", "bfloat16", "--context-length", "256", "--max-total-tokens", "1024",
                       "--max-running-requests", "4", "--lora-backend", "torch", "--attention-backend", "torch",
                       start_timeout_s=600) as server:  # fmt: skip
        info = server.get("/server_info").json()
        assert (info["model_type"], info["num_hidden_layers"], info["load_format"]) == ("gpt_oss", 2, "dummy")
        assert info["quantization"] == "mxfp4"
        sampling = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        prompt = "The morning was cold and clear, and the old farmer walked slowly down the lane"
        resp = server.post("/generate", {"text": prompt, "sampling_params": sampling})
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert len(out["output_ids"]) == 4 and all(0 <= t < 201088 for t in out["output_ids"])
        log = server.log()
    # 2 layers x 4 experts x (gate_up 5760 + down 2880 rows) x 2880 inputs at 1/2 + 1/32 byte: 100.9 MiB
    match = re.search(r"expert weights ([\d.]+) MiB resident on this rank \(([\d.]+) MiB as bfloat16\)", log)
    assert match is not None, log
    assert float(match[1]) == pytest.approx(2 * 4 * (5760 + 2880) * 2880 * (1 / 2 + 1 / 32) / 2**20, abs=0.1)
    assert float(match[2]) == pytest.approx(2 * 4 * (5760 + 2880) * 2880 * 2 / 2**20, abs=0.1)
