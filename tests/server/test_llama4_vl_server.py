"""Llama 4 with images through a whole server: the openai client's chat with data: URL images (one tile, and two
tiled images with their global tiles) equals transformers' greedy answer, cold and with the images' pages from the
prefix cache; and Llama-4-Scout's real config.json (its Hub values, written here) starts with dummy weights, its
vision model at the real widths, and answers an image request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.image_inputs import data_url
from tests.llama4_vision_models import (
    CHAT_TEMPLATE,
    build_llama4_vl,
    hf_llama4_vl,
    make_tokenizer,
    token_ids,
    write_preprocessor_config,
)
from tests.llama4_vision_requests import TOKENS_PER_TILE, hf_inputs
from tests.server_utils import ServerProcess
from tests.vision_models import png_bytes
from tests.vision_models import test_image as make_image

MAX_NEW = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4_vl")
    build_llama4_vl(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    # pages of 4 and chunks of 8: the tiles' runs of 4 are cut by chunks, and a repeated image fills cached pages
    with ServerProcess("--model-path", str(model_dir), "--served-model-name", "l4", "--context-length", "256",
                       "--max-total-tokens", "2048", "--page-size", "4", "--chunked-prefill-size", "8") as proc:
        yield proc


def image_part(image) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(png_bytes(image))}}


def test_answers_with_images_equal_transformers_greedy(server, model_dir) -> None:
    import openai

    assert server.get("/server_info").json()["modalities"] == ["text", "image"]
    model = hf_llama4_vl(str(model_dir))
    tokenizer = make_tokenizer()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    cases = [[make_image(16, 16, seed=0)], [make_image(20, 40, seed=1), make_image(32, 14, seed=2)], []]
    wants = []
    for images in cases:
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "what is it"}]
        text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], chat_template=CHAT_TEMPLATE,
                                             tokenize=False, add_generation_prompt=True)  # fmt: skip
        hf = hf_inputs(text, images)
        with torch.no_grad():
            out = model.generate(**hf, max_new_tokens=MAX_NEW, do_sample=False)
        wants.append((hf["input_ids"].shape[1], tokenizer.decode(out[0, hf["input_ids"].shape[1] :],
                                                                 skip_special_tokens=True)))  # fmt: skip
    for repeat in range(2):  # the second time, the images' pages come from the prefix cache
        for images, (num_prompt, want) in zip(cases, wants, strict=True):
            content = [image_part(image) for image in images] + [{"type": "text", "text": "what is it"}]
            got = client.chat.completions.create(model="l4", messages=[{"role": "user", "content": content}],
                                                 max_tokens=MAX_NEW, temperature=0)  # fmt: skip
            assert got.usage.prompt_tokens == num_prompt
            assert got.choices[0].message.content == want, (repeat, len(images))
            if repeat and images:
                assert got.usage.prompt_tokens_details.cached_tokens >= TOKENS_PER_TILE * len(images)
    # /generate: the text's <|image|> per image_data item, expanded as in chat (one tile: 3 markers and its run)
    sampling = {"max_new_tokens": 1}
    plain = server.post("/generate", {"text": "describe", "sampling_params": sampling}).json()
    body = {"text": "<|image|>describe", "image_data": data_url(png_bytes(cases[0][0])), "sampling_params": sampling}
    imaged = server.post("/generate", body).json()
    assert imaged["meta_info"]["prompt_tokens"] == plain["meta_info"]["prompt_tokens"] + 3 + TOKENS_PER_TILE
    assert server.get("/server_info").json()["num_requests_in_flight"] == 0


# meta-llama/Llama-4-Scout-17B-16E-Instruct's config.json (the smallest Llama 4 with images), its values as the Hub
# publishes them
SCOUT = {
    "architectures": ["Llama4ForConditionalGeneration"],
    "boi_token_index": 200080,
    "eoi_token_index": 200081,
    "image_token_index": 200092,
    "model_type": "llama4",
    "text_config": {
        "attention_bias": False,
        "attention_chunk_size": 8192,
        "attention_dropout": 0.0,
        "bos_token_id": 200000,
        "eos_token_id": [200001, 200007, 200008],
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "interleave_moe_layer_step": 1,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "max_position_embeddings": 10485760,
        "model_type": "llama4_text",
        "num_attention_heads": 40,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "num_local_experts": 16,
        "pad_token_id": 200018,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "torch_dtype": "bfloat16",
        "use_qk_norm": True,
        "vocab_size": 202048,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vision_config": {
        "attention_dropout": 0.0,
        "hidden_act": "gelu",
        "hidden_size": 1408,
        "image_size": 336,
        "initializer_range": 0.02,
        "intermediate_size": 5632,
        "model_type": "llama4_vision_model",
        "multi_modal_projector_bias": False,
        "norm_eps": 1e-05,
        "num_attention_heads": 16,
        "num_channels": 3,
        "num_hidden_layers": 34,
        "patch_size": 14,
        "pixel_shuffle_ratio": 0.5,
        "projector_dropout": 0.0,
        "projector_input_dim": 4096,
        "projector_output_dim": 4096,
        "rope_theta": 10000,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
        "vision_output_dim": 4096,
    },
}


def test_scout_config_answers_an_image_with_dummy_weights(tmp_path: Path) -> None:
    """Scout's widths (text 5120, vision 1408 in tiles of 336 pixels: 144 placeholders a tile) with one layer of
    each, two experts and a small vocabulary and expert width (--hf-overrides), the tests' tokenizer (its image
    tokens' ids: image_token_index follows the tokenizer's `<|patch|>`)."""
    model_dir = tmp_path / "scout"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(SCOUT))
    make_tokenizer().save_pretrained(model_dir)
    write_preprocessor_config(model_dir)
    preprocessor = json.loads((model_dir / "preprocessor_config.json").read_text())
    preprocessor.update(size={"height": 336, "width": 336}, max_patches=16)  # Scout's own
    (model_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    ids = token_ids()
    overrides = {"num_hidden_layers": 1, "num_local_experts": 2, "vocab_size": 2048, "intermediate_size": 256,
                 "intermediate_size_mlp": 512, "vision_config": {"num_hidden_layers": 1},
                 "image_token_index": ids["<|patch|>"], "boi_token_index": ids["<|image_start|>"],
                 "eoi_token_index": ids["<|image_end|>"]}  # fmt: skip
    with ServerProcess("--model-path", str(model_dir), "--served-model-name", "scout", "--load-format", "dummy",
                       "--hf-overrides",
                       json.dumps(overrides), "--context-length", "512", "--max-total-tokens", "1024",
                       "--lora-backend", "torch", "--attention-backend", "torch", start_timeout_s=600) as server:
        info = server.get("/server_info").json()
        assert (info["model_type"], info["load_format"], info["modalities"]) == ("llama4", "dummy", ["text", "image"])
        body = {"model": "scout", "max_tokens": 3,
                "temperature": 0, "messages": [{"role": "user", "content": [
                    image_part(make_image(64, 48, seed=3)), {"type": "text", "text": "what is it"}]}]}  # fmt: skip
        resp = server.post("/v1/chat/completions", body, timeout=120)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        # one tile (a small image is never upsampled past one): the template's <|image|> became <|image_start|>,
        # <|image|>, the tile's 144 placeholders and <|image_end|>
        text_only = server.post("/v1/chat/completions", {**body, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is it"}]}]}).json()  # fmt: skip
        assert out["usage"]["prompt_tokens"] == text_only["usage"]["prompt_tokens"] + 3 + 144
        assert out["usage"]["completion_tokens"] == 3
