"""A Qwen3-MoE checkpoint whose attention, dense MLP and every expert are quantized (FP8 in blocks, AWQ INT4,
compressed-tensors INT4), served end
to end with chunked prefill and the prefix cache: one batch mixing the base model, an attention-only adapter and an
adapter on every expert equals HF + peft on the same weights dequantized; each worker logs its experts' resident
bytes against the plain ones."""

from __future__ import annotations

import re

import pytest

from tests.quantized_moe import build_quantized_moe
from tests.reference import assert_mixed_batch_equals_peft
from tests.server_utils import CHUNKED_ARGS, ServerProcess

MAX_NEW = 6
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
NAMES = [None, "a4", "a8", "a4"]
# format -> the method /server_info names
METHODS = {"fp8-block": "fp8", "awq-4bit": "awq", "ct-w4a16": "compressed-tensors"}


@pytest.fixture(scope="module")
def quantized_moe(tmp_path_factory: pytest.TempPathFactory):
    return build_quantized_moe(tmp_path_factory.mktemp("quantized-moe"), tuple(METHODS), with_tokenizer=True)


@pytest.mark.parametrize("fmt", sorted(METHODS))
def test_quantized_experts_serve_as_their_dequantized_model(fmt: str, quantized_moe) -> None:
    checkpoints, adapters = quantized_moe
    quant_dir, dequant_dir = checkpoints[fmt]
    lora_paths = [f"{name}={path}" for name, path in adapters.items()]
    with ServerProcess("--model-path", str(quant_dir), "--lora-paths", *lora_paths, *CHUNKED_ARGS) as server:
        assert server.get("/server_info").json()["quantization"] == METHODS[fmt]
        assert_mixed_batch_equals_peft(server, dequant_dir, adapters, NAMES, GREEDY)
        log = server.log()
    held = re.search(r"expert weights ([\d.]+) MiB resident on this rank \(([\d.]+) MiB as float32\)", log)
    assert held is not None, log[-2000:]
    assert 0 < float(held[1]) < float(held[2]) / 3, held[0]
