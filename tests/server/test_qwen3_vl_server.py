"""Qwen3-VL through a whole server: the openai client's chat with data: URL images answers as transformers' greedy
generate does (one image, two, none; chunked prefill cutting the images' runs, and the second time the prefix cache
serving them), and Qwen3-VL-2B-Instruct's and Qwen2.5-VL-3B-Instruct's real config.json and preprocessor_config.json
start with dummy weights (--hf-overrides shrinking the decoder and the tower) and answer an image request."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

from tests.qwen3_vl_models import build_qwen3_vl, make_image_processor
from tests.server_utils import ServerProcess
from tests.vision_models import (
    CHAT_TEMPLATE,
    IMAGE_PAD,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    hf_inputs,
    make_tokenizer,
    png_bytes,
    save_tokenizer,
)
from tests.vision_models import test_image as make_image

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_vl")
    build_qwen3_vl(path)
    return path


def image_part(image) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png_bytes(image))
                                                      .decode()}}  # fmt: skip


def test_answers_with_images_equal_transformers_greedy(model_dir) -> None:
    import openai
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = make_tokenizer()
    cases = [[make_image(32, 32, seed=0)], [make_image(32, 32, seed=1), make_image(48, 32, seed=2)], []]
    wants = []
    for images in cases:
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "what is it"}]
        text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], chat_template=CHAT_TEMPLATE,
                                             tokenize=False, add_generation_prompt=True)  # fmt: skip
        hf = hf_inputs(text, images, make_image_processor())
        with torch.no_grad():
            out = model.generate(**hf, max_new_tokens=MAX_TOKENS, do_sample=False)
        wants.append((hf["input_ids"].shape[1], tokenizer.decode(out[0, hf["input_ids"].shape[1] :],
                                                                 skip_special_tokens=True)))  # fmt: skip
    # pages of 4 and chunks of 8: every image's run (16 placeholders or more) is cut by chunks
    with ServerProcess("--model-path", str(model_dir), "--served-model-name", "vl", "--context-length", "512",
                       "--max-total-tokens", "2048", "--page-size", "4", "--chunked-prefill-size", "8") as server:
        assert server.get("/server_info").json()["modalities"] == ["text", "image"]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        for repeat in range(2):  # the second time, the images' pages come from the prefix cache
            for images, (num_prompt, want) in zip(cases, wants, strict=True):
                content = [image_part(image) for image in images] + [{"type": "text", "text": "what is it"}]
                got = client.chat.completions.create(model="vl", messages=[{"role": "user", "content": content}],
                                                     max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
                assert got.usage.prompt_tokens == num_prompt
                assert got.choices[0].message.content == want, (repeat, len(images))
                if repeat and images:
                    assert got.usage.prompt_tokens_details.cached_tokens >= 16 * len(images)


# Qwen/Qwen3-VL-2B-Instruct's config.json as published (transformers 4.57's form: the decoder's rope in
# text_config.rope_scaling, interleaved M-RoPE), its token ids put at the tests' tokenizer's
QWEN3_VL_2B = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "dtype": "bfloat16", "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 262144, "model_type": "qwen3_vl_text", "num_attention_heads": 16,
        "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000, "tie_word_embeddings": True, "use_cache": True, "vocab_size": 151936,
    },
    "tie_word_embeddings": True,
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1024,
        "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096, "model_type": "qwen3_vl",
        "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    },
}
QWEN3_VL_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}
# Qwen/Qwen2.5-VL-3B-Instruct's config.json and preprocessor_config.json as published (the decoder at the top level,
# rope_scaling's mrope sections)
QWEN2_5_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "attention_dropout": 0.0,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11008,
    "max_position_embeddings": 128000, "max_window_layers": 70, "num_attention_heads": 16, "num_hidden_layers": 36,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {
        "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
        "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
        "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
}
QWEN2_5_VL_PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
}
# family -> (config, preprocessor config, --hf-overrides: two decoder layers and two tower blocks, the image's
# placeholders for a 32x32 image: Qwen3-VL's processor scales it to 256x256 (shortest_edge 65536), 16x16 patches, 64
# tokens; Qwen2.5-VL's to 56x56 (min_pixels 3136), 4x4 patches, 4 tokens)
REAL_CONFIGS = {
    "qwen3_vl": (QWEN3_VL_2B, QWEN3_VL_PREPROCESSOR,
                 {"num_hidden_layers": 2, "vision_config": {"depth": 2, "deepstack_visual_indexes": [0, 1]}}, 64),
    "qwen2_5_vl": (QWEN2_5_VL_3B, QWEN2_5_VL_PREPROCESSOR,
                   {"num_hidden_layers": 2, "vision_config": {"depth": 2, "fullatt_block_indexes": [1]}}, 4),
}


@pytest.mark.parametrize("family", sorted(REAL_CONFIGS))
def test_real_config_serves_an_image_with_dummy_weights(tmp_path: Path, family: str) -> None:
    import openai

    published, preprocessor, overrides, image_tokens = REAL_CONFIGS[family]
    tokenizer = make_tokenizer()
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image", IMAGE_PAD), ("video", VIDEO_PAD), ("vision_start", VISION_START), ("vision_end", VISION_END))}
    config = {**published, **ids, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    if "text_config" in config:
        config["text_config"] = {**config["text_config"], "bos_token_id": tokenizer.bos_token_id,
                                 "eos_token_id": tokenizer.eos_token_id}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    save_tokenizer(tmp_path)
    with ServerProcess("--model-path", str(tmp_path), "--served-model-name", "vl", "--load-format", "dummy",
                       "--hf-overrides", json.dumps(overrides), "--dtype", "bfloat16", "--context-length", "256",
                       "--max-total-tokens", "1024", "--max-running-requests", "4", "--lora-backend", "torch",
                       "--attention-backend", "torch", start_timeout_s=600) as server:  # fmt: skip
        info = server.get("/server_info").json()
        assert (info["model_type"], info["num_hidden_layers"], info["modalities"]) == (family, 2, ["text", "image"])
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        content = [{"type": "text", "text": "what is it"}]
        text_only = client.chat.completions.create(model="vl", messages=[{"role": "user", "content": content}],
                                                   max_tokens=4, temperature=0)  # fmt: skip
        got = client.chat.completions.create(model="vl", max_tokens=4, temperature=0, messages=[
            {"role": "user", "content": [image_part(make_image(32, 32)), *content]}])  # fmt: skip
        assert got.usage.prompt_tokens == text_only.usage.prompt_tokens + 2 + image_tokens
        assert got.usage.completion_tokens == 4 and got.choices[0].finish_reason == "length"
