"""Gemma 4 with images through a whole server: chat image_url parts (the openai client with data: URLs) on the tiny
Gemma 4 of tests/gemma4_vision_models.py give transformers' greedy answers, each image's placeholders wrapped in its
begin and end tokens as the processor lays them out, each attending over its whole run (use_bidirectional_attention
"vision"), chunked prefill around the runs and, asked again, the prefix cache serving the images' pages; audio and
video parts are 400s naming the part."""

from __future__ import annotations

import base64

import pytest
import torch

from tests.gemma4_vision_models import CHAT_TEMPLATE, build_gemma4_vl, hf_inputs, make_tokenizer
from tests.server_utils import ServerProcess
from tests.vision_models import png_bytes
from tests.vision_models import test_image as make_image

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4_vl")
    # image tokens that attend both ways: the workers' ready message has the scheduler keep each run in one pass
    build_gemma4_vl(path, use_bidirectional_attention="vision")
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    # chunks of 32 would cut a 64-token image run (it goes whole); pages of 4 let a repeated image's pages come from
    # the prefix cache
    with ServerProcess("--model-path", str(model_dir), "--served-model-name", "g4", "--context-length", "512",
                       "--max-total-tokens", "4096", "--page-size", "4", "--chunked-prefill-size", "32") as proc:
        yield proc


def image_part(image) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def test_answers_with_images_equal_transformers_greedy(server, model_dir):
    import openai
    from transformers import Gemma4ForConditionalGeneration

    assert server.get("/server_info").json()["modalities"] == ["text", "image"]
    model = Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = make_tokenizer()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    cases = [[make_image(32, 32, seed=0)], [make_image(32, 32, seed=1), make_image(40, 24, seed=2)]]
    for repeat in range(2):  # the second time, the images' pages come from the prefix cache
        for images in cases:
            parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "what is it"}]
            text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], chat_template=CHAT_TEMPLATE,
                                                 tokenize=False, add_generation_prompt=True)  # fmt: skip
            hf = hf_inputs(text, images)
            with torch.no_grad():
                out = model.generate(**hf, max_new_tokens=MAX_TOKENS, do_sample=False)
            want = tokenizer.decode(out[0, hf["input_ids"].shape[1] :], skip_special_tokens=True)
            content = [image_part(image) for image in images] + [{"type": "text", "text": "what is it"}]
            got = client.chat.completions.create(model="g4", messages=[{"role": "user", "content": content}],
                                                 max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
            assert got.usage.prompt_tokens == hf["input_ids"].shape[1]
            assert got.choices[0].message.content == want, (repeat, len(images))
            if repeat:
                assert got.usage.prompt_tokens_details.cached_tokens >= 60 * len(images)


@pytest.mark.parametrize("part", [
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
])  # fmt: skip
def test_audio_and_video_parts_are_400s_naming_the_part(server, part):
    body = {"model": "g4", "max_tokens": 2,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "what?"}]}]}  # fmt: skip
    resp = server.post("/v1/chat/completions", body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert part["type"] in error["message"] and error["type"] == "BadRequestError", error
    assert server.get("/server_info").json()["num_requests_in_flight"] == 0
