"""Gemma 3's image inputs in the frontend (frontend/multimodal/gemma3.py) on the tiny checkpoint's tokenizer and
image processor, no weights: each `<start_of_image>` laid out as Gemma3Processor lays it (tests/gemma3_vl_models.
hf_inputs), whitespace beside it tokenized with the blank lines, the processor's pixels; and where the scheduler may
end a chunk of such a prompt (scheduler/image_runs.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from loraplex.frontend.errors import InputError
from loraplex.frontend.multimodal.images import ImagePipeline
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import ImageInput
from loraplex.scheduler.image_runs import whole_image_len
from loraplex.scheduler.scheduler import Scheduler

from tests.gemma3_vl_models import BOI, SOFT, TOKENS_PER_IMAGE, hf_config, hf_inputs, make_image_processor
from tests.gemma3_vl_models import make_tokenizer as make_gemma3_tokenizer
from tests.image_inputs import data_url
from tests.unit.test_image_scheduler import image_req, run
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


def test_a_chunk_never_ends_inside_an_image_run() -> None:
    images = [ImageInput(offset=5, num_tokens=16, content_hash="a", pixel_values=b"", shape=[]),
              ImageInput(offset=30, num_tokens=16, content_hash="b", pixel_values=b"", shape=[])]
    assert whole_image_len(images, 0, 4, alone=True) == 4  # before the first run
    assert whole_image_len(images, 0, 8, alone=True) == 5  # cut back to the run's start
    assert whole_image_len(images, 5, 8, alone=True) == 16  # the run whole, past the budget, when alone
    assert whole_image_len(images, 5, 8, alone=False) == 0  # else not this step
    assert whole_image_len(images, 12, 8, alone=True) == 9  # from inside a run (a prefix hit): through its end
    assert whole_image_len(images, 21, 30, alone=False) == 30  # both ends outside every run


def test_the_scheduler_keeps_each_image_run_in_one_pass() -> None:
    """images_whole (WorkerReady.images_whole): chunks of 4 over prompts with a 6-token image run: no pass ends inside
    a run, the run goes whole (past the budget) when it starts a pass, and a request beside another waits for a
    pass it has alone; without the flag the runs are cut."""
    for whole in (True, False):
        scheduler = Scheduler(ServerConfig(page_size=4), num_pages=32, context_length=256, chunked_prefill_size=4,
                              images_whole=whole)  # fmt: skip
        reqs = [image_req("a", [1, 2, 3]), image_req("b", [1, 2, 3, 4, 5], content="dog")]
        for req in reqs:
            scheduler.add_request(req)
        passes, finished = run(scheduler)
        assert set(finished) == {"a", "b"}
        cuts = []
        for req in reqs:
            [image] = req.images
            for fwd in passes[req.rid]:
                end = fwd.num_cached_tokens + len(fwd.input_ids)
                cuts.append(image.offset < end < image.offset + image.num_tokens)
        assert not any(cuts) if whole else any(cuts)
