"""Images through a whole server's edges: chat image_url parts (the openai client with a data: URL) and /generate's
image_data reach the scheduler as expanded prompts, and 22 kinds of bad image input are each a 400 naming the cause
(OpenAI: type BadRequestError; native: error.message), after which the server still serves a greedy request
exactly as before, with nothing left in flight.

The server serves the tiny Qwen2.5-VL (tests/vision_models.py), and its answers with one and two images equal
transformers' greedy ones, chunked prefill cutting the images and the prefix cache serving a repeated image."""

from __future__ import annotations

import base64
import os

import pytest
import torch

from tests.image_inputs import BAD_FILES, GOOD_PNG, ImageServer, data_url
from tests.net import free_port
from tests.server_utils import ServerProcess
from tests.vision_models import (
    CHAT_TEMPLATE,
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    build_qwen2_5_vl,
    hf_inputs,
    make_tokenizer,
    png_bytes,
)
from tests.vision_models import test_image as make_image

TOKENS_PER_IMAGE = 16  # a 32x32 image: 8x8 patches of 4, merged 2x2
LIMIT = 2


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir(), outside.mkdir()
    (allowed / "cat.png").write_bytes(GOOD_PNG)
    (outside / "secret.png").write_bytes(GOOD_PNG)
    os.symlink(outside / "secret.png", allowed / "escape.png")
    return allowed, outside


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vision_model")
    build_qwen2_5_vl(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir, media):
    # pages of 4 and chunks of 8: a 16-token image run is cut by chunks, and a repeated image fills cached pages
    with ServerProcess("--model-path", str(model_dir), "--served-model-name", "vl", "--context-length", "512",
                       "--max-total-tokens", "4096", "--page-size", "4", "--chunked-prefill-size", "8",
                       "--allowed-local-media-path", str(media[0]),
                       "--limit-mm-per-prompt", f'{{"image": {LIMIT}}}') as proc:  # fmt: skip
        yield proc


@pytest.fixture(scope="module")
def images():
    with ImageServer() as served:
        yield served


def chat_body(*parts: dict, max_tokens: int = 4) -> dict:
    return {"model": "vl", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "what?"}]}],
            "max_tokens": max_tokens, "temperature": 0}  # fmt: skip


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_images_in_chat_and_generate_reach_the_model_expanded(server, images, media):
    import openai

    assert server.get("/server_info").json()["modalities"] == ["text", "image"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    text_only = client.chat.completions.create(**chat_body())
    one = client.chat.completions.create(**chat_body(image_part(data_url(GOOD_PNG))))
    # the template's one <|image_pad|> became 16; the same image by file:// and by http:// is the same prompt
    assert one.usage.prompt_tokens == text_only.usage.prompt_tokens + 2 + TOKENS_PER_IMAGE
    for url in (f"file://{media[0]}/cat.png", images.url("/ok.png"), images.url("/same-host")):
        again = client.chat.completions.create(**chat_body(image_part(url)))
        assert again.usage.prompt_tokens == one.usage.prompt_tokens
        assert again.choices[0].message.content == one.choices[0].message.content
    two = client.chat.completions.create(**chat_body(image_part(data_url(GOOD_PNG)), image_part(images.url("/ok.png"))))
    assert two.usage.prompt_tokens == one.usage.prompt_tokens + 2 + TOKENS_PER_IMAGE
    # /tokenize gives the chat's prompt as generation has it: each image's placeholders expanded
    tokenized = server.post("/tokenize", {"model": "vl", "messages": chat_body(image_part(data_url(GOOD_PNG)))[
        "messages"]}).json()  # fmt: skip
    assert tokenized["count"] == one.usage.prompt_tokens
    # /generate: one placeholder per image in the text, image_data as a string, a list, and a batch's list of lists
    prompt = f"{VISION_START}{IMAGE_PAD}{VISION_END} describe"
    body = {"text": prompt, "image_data": data_url(GOOD_PNG), "sampling_params": {"max_new_tokens": 2}}
    single = server.post("/generate", body).json()
    raw_base64 = data_url(GOOD_PNG).split(",", 1)[1]
    listed = server.post("/generate", {**body, "image_data": [raw_base64]}).json()
    assert single["meta_info"]["prompt_tokens"] == listed["meta_info"]["prompt_tokens"]
    batch = server.post("/generate", {**body, "text": [prompt, "plain", prompt + prompt],
                                      "image_data": [[raw_base64], None, [f"{media[0]}/cat.png", raw_base64]]}).json()
    counts = [item["meta_info"]["prompt_tokens"] for item in batch]
    assert counts[0] == single["meta_info"]["prompt_tokens"] and counts[2] == 2 * counts[0] - 1  # one BOS
    assert server.get("/server_info").json()["num_requests_in_flight"] == 0


def test_answers_with_images_equal_transformers_greedy(server, model_dir):
    import openai
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = make_tokenizer()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    cases = [[make_image(32, 32, seed=0)], [make_image(32, 32, seed=1), make_image(48, 32, seed=2)], []]
    for repeat in range(2):  # the second time, the images' pages come from the prefix cache
        for images in cases:
            parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "what is it"}]
            text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], chat_template=CHAT_TEMPLATE,
                                                 tokenize=False, add_generation_prompt=True)  # fmt: skip
            hf = hf_inputs(text, images)
            hf["mm_token_type_ids"] = (hf["input_ids"] == tokenizer.convert_tokens_to_ids(IMAGE_PAD)).int()
            with torch.no_grad():
                out = model.generate(**hf, max_new_tokens=8, do_sample=False)
            want = tokenizer.decode(out[0, hf["input_ids"].shape[1] :], skip_special_tokens=True)
            urls = ["data:image/png;base64," + base64.b64encode(png_bytes(image)).decode() for image in images]
            content = [image_part(url) for url in urls] + [{"type": "text", "text": "what is it"}]
            got = client.chat.completions.create(model="vl", messages=[{"role": "user", "content": content}],
                                                 max_tokens=8, temperature=0)  # fmt: skip
            assert got.usage.prompt_tokens == hf["input_ids"].shape[1]
            assert got.choices[0].message.content == want, (repeat, len(images))
            if repeat and images:
                assert got.usage.prompt_tokens_details.cached_tokens >= 16 * len(images)


def bad_inputs(images, media) -> dict[str, tuple[str, dict, str]]:
    """kind -> (route, body, words of the 400's message)."""
    allowed, outside = media
    chat = {f"chat: {kind}": ("/v1/chat/completions", chat_body(image_part(data_url(data))), words)
            for kind, (data, words) in BAD_FILES.items()}  # fmt: skip
    closed = f"http://127.0.0.1:{free_port()}/cat.png"
    for kind, url, words in [
        ("wrong MIME", "data:text/plain;base64,aGVsbG8=", "not an image type"),
        ("bad base64", "data:image/png;base64,%%%%", "not valid base64"),
        ("closed port", closed, "could not fetch"),
        ("redirect to another host", images.url("/other-host"), "another host"),
        ("too big a download", images.url("/huge"), "larger than"),
        ("missing URL", images.url("/missing"), "HTTP 404"),
        ("path outside the allowed dir", f"file://{outside}/secret.png", "outside --allowed-local-media-path"),
        ("symlink out of the allowed dir", f"file://{allowed}/escape.png", "outside --allowed-local-media-path"),
        ("unsupported scheme", "ftp://127.0.0.1/cat.png", "unsupported image URL"),
    ]:
        chat[f"chat: {kind}"] = ("/v1/chat/completions", chat_body(image_part(url)), words)
    many = [image_part(data_url(GOOD_PNG))] * (LIMIT + 1)
    chat["chat: too many images"] = ("/v1/chat/completions", chat_body(*many), "more than the 2")
    chat["chat: unknown content part type"] = ("/v1/chat/completions",
                                               chat_body({"type": "input_audio", "input_audio": {}}), "input_audio")
    chat["chat: image_url without url"] = ("/v1/chat/completions",
                                           chat_body({"type": "image_url", "image_url": {}}), "url")
    prompt = f"{VISION_START}{IMAGE_PAD}{VISION_END} describe"
    native = {
        "image_data of the wrong type": ({"text": prompt, "image_data": 7}, "image_data"),
        "image_data not one per prompt": ({"text": [prompt, prompt], "image_data": [data_url(GOOD_PNG)]},
                                          "a list of 2 items"),
        "no placeholder for the image": ({"text": "describe", "image_data": data_url(GOOD_PNG)},
                                         "0 image placeholder token"),
        "raw garbage for base64": ({"text": prompt, "image_data": "not*an*image"}, "not valid base64"),
    }
    return {**chat, **{f"generate: {kind}": ("/generate", body, words) for kind, (body, words) in native.items()}}


def test_bad_image_inputs_are_400s_and_the_server_serves_exactly_after(server, images, media):
    reference = {"text": "one two three", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    before = server.post("/generate", reference).json()
    cases = bad_inputs(images, media)
    assert len(cases) >= 20
    for kind, (route, body, words) in cases.items():
        resp = server.post(route, body, timeout=60)
        assert resp.status_code == 400, (kind, resp.status_code, resp.text)
        error = resp.json()["error"]
        assert words in error["message"], (kind, error["message"])
        if route.startswith("/v1"):
            assert error["type"] == "BadRequestError", (kind, error)
    assert server.post("/generate", reference).json()["text"] == before["text"]
    info = server.get("/server_info").json()
    assert info["healthy"] and info["num_requests_in_flight"] == 0
