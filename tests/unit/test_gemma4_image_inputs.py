"""Gemma 4's images in the frontend (frontend/multimodal/), no model weights: the config's vision facts (each image's
run wrapped in its begin and end tokens, whether or not its image tokens attend both ways), and a
prompt expanded as Gemma4Processor lays it out (tests/gemma4_vision_models.hf_inputs), its patches those of the
image processor without their padding."""

from __future__ import annotations

import asyncio

import pytest
import torch
from loraplex.frontend.multimodal.families import vision_spec
from loraplex.frontend.multimodal.images import ImagePipeline
from loraplex.protocol.config import ServerConfig

from tests.gemma4_vision_models import (
    BOI,
    EOI,
    IMAGE,
    hf_config,
    hf_inputs,
    make_image_processor,
    make_tokenizer,
    token_ids,
)
from tests.image_inputs import data_url
from tests.vision_models import png_bytes
from tests.vision_models import test_image as make_image


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> ImagePipeline:
    path = tmp_path_factory.mktemp("gemma4_vl_config")
    hf_config().save_pretrained(path)  # config.json and the image processor's file: all the frontend reads
    make_image_processor().save_pretrained(path)
    images = ImagePipeline.load(str(path), ServerConfig())
    yield images
    images.close()


def test_the_config_gives_the_vision_facts(pipeline) -> None:
    ids = token_ids()
    spec = pipeline.spec
    assert (spec.image_token_id, spec.begin_token_id, spec.end_token_id) == (ids[IMAGE], ids[BOI], ids[EOI])
    assert not spec.mrope and pipeline.modalities == ["text", "image"]
    config = hf_config().to_dict()
    both_ways = {**config, "text_config": {**config["text_config"], "use_bidirectional_attention": "vision"}}
    assert vision_spec(both_ways) == spec  # the workers attend its image tokens both ways
    assert vision_spec({**config, "vision_config": None}) is None
    assert vision_spec({"model_type": "gemma4_text", "image_token_id": 5}) is None


def test_prompts_expand_as_the_processor_lays_them_out(pipeline) -> None:
    images = [make_image(32, 32, seed=1), make_image(40, 24, seed=2)]
    prompt = f"look {IMAGE} and {IMAGE} ?"
    want = hf_inputs(prompt, images)
    ids = make_tokenizer()(prompt, add_special_tokens=False)["input_ids"]  # one image token per image, as a chat
    # template leaves them
    sources = [(f"image {k}", data_url(png_bytes(image))) for k, image in enumerate(images)]
    got = asyncio.run(pipeline.prompt(ids, sources, "prompt"))
    assert got.input_ids == want["input_ids"][0].tolist()
    for image, pixels, xy in zip(got.images, want["pixel_values"], want["image_position_ids"], strict=True):
        real = (xy != -1).all(-1)
        ours = torch.frombuffer(bytearray(image.pixel_values), dtype=torch.float32).view(image.shape)
        assert torch.equal(ours, pixels[real])
        assert image.grid_thw == [1, int(xy[real, 1].max()) + 1, int(xy[real, 0].max()) + 1]
        run = got.input_ids[image.offset - 1 : image.offset + image.num_tokens + 1]
        assert run == [token_ids()[BOI], *[token_ids()[IMAGE]] * image.num_tokens, token_ids()[EOI]]
    assert [image.num_tokens for image in got.images] == [64, 60]
