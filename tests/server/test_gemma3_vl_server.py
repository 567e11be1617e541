"""Gemma 3 with images through a whole server: the openai client's chat with data: URL images answers as transformers'
greedy generate does (Gemma3Processor's layout of each image, its soft tokens attending both ways; chunks of 8 that
the scheduler keeps off an image's 16 soft tokens; the second time round the images' pages from the prefix cache).
And the Hub config of google/gemma-3-4b-it (tests/data/model_configs/gemma-3-4b-it: config.json and
preprocessor_config.json as published) starts with dummy weights, its layers cut and its tower narrowed by
--hf-overrides, and answers an image request at its real 896x896 image size."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.builders import build_tokenizer
from tests.gemma3_vl_models import CHAT_TEMPLATE, build_gemma3_vl, hf_inputs, make_tokenizer
from tests.server_utils import ServerProcess
from tests.vision_models import png_bytes
from tests.vision_models import test_image as make_image

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "data" / "model_configs"
MAX_NEW = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_vl")
    build_gemma3_vl(path)
    return path


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def test_chat_with_images_equals_transformers_greedy(model_dir):
    import openai
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = make_tokenizer()
    cases = [[make_image(32, 32, seed=0)], [make_image(32, 32, seed=1), make_image(48, 32, seed=2)], []]
    with ServerProcess("--model-path", str(model_dir), "--served-model-name", "g3", "--context-length", "256",
                       "--max-total-tokens", "2048", "--page-size", "4", "--chunked-prefill-size", "8",
                       "--attention-backend", "torch") as server:  # fmt: skip
        assert server.get("/server_info").json()["modalities"] == ["text", "image"]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        for repeat in range(2):  # the second time, the images' pages come from the prefix cache
            for images in cases:
                parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": " what is it"}]
                text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                                     chat_template=CHAT_TEMPLATE, add_generation_prompt=True)
                hf = hf_inputs(text, images)
                with torch.no_grad():
                    out = model.generate(**hf, max_new_tokens=MAX_NEW, do_sample=False)
                want = tokenizer.decode(out[0, hf["input_ids"].shape[1] :], skip_special_tokens=True)
                content = [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
                got = client.chat.completions.create(
                    model="g3", max_tokens=MAX_NEW, temperature=0,
                    messages=[{"role": "user", "content": [*content, {"type": "text", "text": " what is it"}]}])
                assert got.usage.prompt_tokens == hf["input_ids"].shape[1], (repeat, len(images))
                assert got.choices[0].message.content == want, (repeat, len(images))
                if repeat and images:
                    assert got.usage.prompt_tokens_details.cached_tokens >= 16 * len(images)
        info = server.get("/server_info").json()
        assert info["num_requests_in_flight"] == 0


def test_gemma_3_4b_config_answers_an_image_with_dummy_weights(tmp_path: Path) -> None:
    model_dir = tmp_path / "gemma-3-4b-it"
    shutil.copytree(CONFIGS_DIR / "gemma-3-4b-it", model_dir)
    build_tokenizer(model_dir)  # the tests' tiny tokenizer: its ids are inside the real vocabulary
    # the language model at its real widths and vocabulary; the tower's one block narrowed (at 1152 wide, 4096
    # patches cost seconds a block here), its image size and patches real
    overrides = {"num_hidden_layers": 2,
                 "vision_config": {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
                                   "num_attention_heads": 4}}  # fmt: skip
    with ServerProcess("--model-path", str(model_dir), "--load-format", "dummy", "--hf-overrides",
                       json.dumps(overrides), "--dtype", "bfloat16", "--context-length", "512",
                       "--max-total-tokens", "2048", "--max-running-requests", "2", "--lora-backend", "torch",
                       "--attention-backend", "torch", start_timeout_s=600) as server:  # fmt: skip
        info = server.get("/server_info").json()
        assert info["model_type"] == "gemma3" and info["modalities"] == ["text", "image"]
        boi = json.loads((model_dir / "config.json").read_text())["boi_token_index"]  # not in the tiny tokenizer
        body = {"input_ids": [2, boi, 300, 301], "image_data": data_url(make_image(64, 48, seed=3)),
                "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
        resp = server.post("/generate", body, timeout=300)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        # the image's 256 soft tokens, its start and end tokens and the blank lines around it
        assert out["meta_info"]["prompt_tokens"] > 256 and len(out["output_ids"]) == 3
