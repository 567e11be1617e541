"""Gemma 3's image inputs in the frontend (frontend/multimodal/gemma3.py) on the tiny checkpoint's tokenizer and
image processor, no weights: each `<start_of_image>` laid out as Gemma3Processor lays it (tests/gemma3_vl_models.
hf_inputs), whitespace beside it tokenized with the blank lines, the processor's pixels. Where the scheduler may end a
chunk of such a prompt (scheduler/image_runs.py): tests/unit/test_whole_image_runs.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from loraplex.frontend.errors import InputError
from loraplex.frontend.multimodal.images import ImagePipeline
from loraplex.protocol.config import ServerConfig

from tests.gemma3_vl_models import BOI, SOFT, TOKENS_PER_IMAGE, hf_config, hf_inputs, make_image_processor
from tests.gemma3_vl_models import make_tokenizer as make_gemma3_tokenizer
from tests.image_inputs import data_url
from tests.vision_models import png_bytes
from tests.vision_models import test_image as make_image


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> ImagePipeline:
    path = tmp_path_factory.mktemp("gemma3_vl_files")  # config, tokenizer and image processor: no weights
    hf_config().save_pretrained(path)
    make_gemma3_tokenizer().save_pretrained(path)
    make_image_processor().save_pretrained(path)
    images = ImagePipeline.load(str(path), ServerConfig(limit_mm_per_prompt={"image": 3}))
    yield images
    images.close()


@pytest.mark.parametrize("prompt", [f"user\n{BOI} and {BOI}?", f"{BOI}\nwhat", f"a {BOI} b"])
def test_images_are_laid_out_as_the_hf_processor_does(pipeline, prompt) -> None:
    images = [make_image(32, 32, seed=k) for k in range(prompt.count(BOI))]
    tokenizer = make_gemma3_tokenizer()
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    sources = [(f"image {k}", data_url(png_bytes(image))) for k, image in enumerate(images)]
    got = asyncio.run(pipeline.prompt(ids, sources, "prompt"))
    want = hf_inputs(prompt, images)
    assert got.input_ids == want["input_ids"][0].tolist()
    soft = tokenizer.convert_tokens_to_ids(SOFT)
    assert [(i.offset, i.num_tokens) for i in got.images] == [
        (k, TOKENS_PER_IMAGE) for k, t in enumerate(got.input_ids) if t == soft and got.input_ids[k - 1] != soft]
    pixels = torch.cat([torch.frombuffer(bytearray(i.pixel_values), dtype=torch.float32).view(i.shape)
                        for i in got.images])  # fmt: skip
    assert torch.equal(pixels, want["pixel_values"]) and not got.mrope_positions


def test_image_start_tokens_other_than_the_images_are_refused(pipeline) -> None:
    tokenizer = make_gemma3_tokenizer()
    source = [("a", data_url(png_bytes(make_image())))]
    for text, words in ((f"{BOI} {BOI}", "2 image start token"), (f"{BOI}{SOFT}", "soft token")):
        with pytest.raises(InputError, match=words):
            asyncio.run(pipeline.prompt(tokenizer(text, add_special_tokens=False)["input_ids"], source, "prompt"))

