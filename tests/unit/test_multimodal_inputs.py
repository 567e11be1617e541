"""The frontend's image inputs (frontend/multimodal/) on the tiny Qwen2.5-VL checkpoint's processor, no server: a
prompt's placeholders expanded as the HF processor does (tests/vision_models.hf_inputs), the pixel values and grids
its image processor gives, the M-RoPE rows transformers' get_rope_index gives; every way to name an image, and every
kind of bad one refused with a message naming the part."""

from __future__ import annotations

import asyncio
import functools
import os
from types import SimpleNamespace

import pytest
import torch
from loraplex.frontend.errors import InputError
from loraplex.frontend.generate import _image_sources
from loraplex.frontend.multimodal.families import vision_spec
from loraplex.frontend.multimodal.images import ImagePipeline
from loraplex.frontend.multimodal.sources import MediaAccess, image_bytes
from loraplex.protocol.config import ServerConfig

from tests.image_inputs import BAD_FILES, GOOD_PNG, ImageServer, data_url
from tests.net import free_port
from tests.vision_models import IMAGE_PAD, build_qwen2_5_vl, hf_config, hf_inputs, make_tokenizer, png_bytes
from tests.vision_models import test_image as make_image


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    build_qwen2_5_vl(path)
    return str(path)


@pytest.fixture(scope="module")
def pipeline(model_dir) -> ImagePipeline:
    images = ImagePipeline.load(model_dir, ServerConfig(limit_mm_per_prompt={"image": 3}))
    yield images
    images.close()


def run(coro):
    return asyncio.run(coro)


def hf_rope_index(input_ids: torch.Tensor, grids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    config = hf_config()
    model = SimpleNamespace(config=config)  # get_rope_index reads the config alone: no weights needed
    model.get_vision_position_ids = functools.partial(Qwen2_5_VLModel.get_vision_position_ids, model)
    token_types = (input_ids == config.image_token_id).int()
    return Qwen2_5_VLModel.get_rope_index(model, input_ids, token_types, grids)


def test_the_checkpoint_config_gives_the_vision_facts(pipeline) -> None:
    spec = pipeline.spec
    tokenizer = make_tokenizer()
    assert spec.image_token_id == tokenizer.convert_tokens_to_ids(IMAGE_PAD) and spec.merge_size == 2 and spec.mrope
    assert pipeline.modalities == ["text", "image"]
    # text models, and multimodal checkpoints served as their language model, take no images
    assert vision_spec({"model_type": "llama"}) is None
    assert vision_spec({"model_type": "mistral3", "vision_config": {}, "image_token_index": 5}) is None
    mrope = {"model_type": "x", "vision_config": {"spatial_merge_size": 2}, "image_token_id": 5,
             "text_config": {"rope_scaling": {"mrope_section": [2, 1, 1]}}}  # fmt: skip
    assert vision_spec(mrope).mrope and not vision_spec({**mrope, "text_config": {}}).mrope


def test_placeholders_expand_as_the_hf_processor_does(pipeline) -> None:
    images = [make_image(32, 32, seed=1), make_image(48, 24, seed=2)]
    prompt = f"<|im_start|>user\n<|vision_start|>{IMAGE_PAD}<|vision_end|>and<|vision_start|>{IMAGE_PAD}<|vision_end|>?"
    tokenizer = make_tokenizer()
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    sources = [(f"image {k}", data_url(png_bytes(image))) for k, image in enumerate(images)]
    got = run(pipeline.prompt(ids, sources, "prompt"))
    want = hf_inputs(prompt, images)
    assert got.input_ids == want["input_ids"][0].tolist()
    pixels = torch.cat([torch.frombuffer(bytearray(i.pixel_values), dtype=torch.float32).view(i.shape)
                        for i in got.images])  # fmt: skip
    assert torch.equal(pixels, want["pixel_values"])
    assert [i.grid_thw for i in got.images] == want["image_grid_thw"].tolist()
    for image in got.images:  # each run starts at its offset, num_tokens long
        run_ids = got.input_ids[image.offset : image.offset + image.num_tokens]
        assert run_ids == [pipeline.spec.image_token_id] * image.num_tokens
    assert sum(i.num_tokens for i in got.images) == got.input_ids.count(pipeline.spec.image_token_id)
    positions, delta = hf_rope_index(want["input_ids"], want["image_grid_thw"])
    assert got.mrope_positions == positions[:, 0].tolist() and got.mrope_delta == int(delta[0])


def test_content_hash_names_the_processed_pixels(pipeline) -> None:
    cat, cat_again, dog = (run(pipeline.process([("x", data_url(png_bytes(make_image(seed=s))))]))[0]
                           for s in (1, 1, 2))  # fmt: skip
    assert cat.content_hash == cat_again.content_hash != dog.content_hash
    jpeg_of_same_size = run(pipeline.process([("x", data_url(png_bytes(make_image(64, 32, seed=1))))]))[0]
    assert jpeg_of_same_size.content_hash != cat.content_hash


def test_a_placeholder_count_other_than_the_images_is_refused(pipeline) -> None:
    ids = make_tokenizer()(f"a {IMAGE_PAD} b", add_special_tokens=False)["input_ids"]
    with pytest.raises(InputError, match="1 image placeholder token.*for 2 image"):
        run(pipeline.prompt(ids, [("a", data_url(GOOD_PNG)), ("b", data_url(GOOD_PNG))], "prompt 0"))


def test_limits_and_text_only_models_refuse_before_reading(pipeline) -> None:
    with pytest.raises(InputError, match="messages: 4 images, more than the 3"):
        pipeline.check_count(4, "messages")
    text_only = ImagePipeline(None, None, MediaAccess(), 4)
    with pytest.raises(InputError, match="this model takes no images"):
        text_only.check_count(1, "messages")
    assert text_only.modalities == ["text"]


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_files_are_refused_naming_the_part(pipeline, kind) -> None:
    data, words = BAD_FILES[kind]
    with pytest.raises(InputError) as caught:
        run(pipeline.process([("messages[0].content[1]", data_url(data))]))
    assert str(caught.value).startswith("messages[0].content[1]: ") and words in str(caught.value)


def test_data_urls_and_raw_base64(pipeline) -> None:
    access = MediaAccess()
    assert run(image_bytes(data_url(GOOD_PNG), "x", access)) == GOOD_PNG
    raw = data_url(GOOD_PNG).split(",", 1)[1]
    assert run(image_bytes(raw, "x", access, bare=True)) == GOOD_PNG  # image_data's raw base64
    refused = {
        "data:text/plain;base64,aGVsbG8=": "not an image type",
        "data:image/png;base64,@@@not base64@@@": "not valid base64",
        "data:image/png,rawbytes": "must be base64",
        "data:image/png;base64": "needs a comma",
        "ftp://127.0.0.1/a.png": "unsupported image URL",
        raw: "unsupported image URL",  # an image_url takes URLs only
        "": "non-empty string",
    }
    for source, words in refused.items():
        with pytest.raises(InputError, match=words):
            run(image_bytes(source, "x", access))


def test_local_files_only_inside_the_allowed_directory(tmp_path) -> None:
    inside, outside = tmp_path / "media", tmp_path / "secret"
    inside.mkdir(), outside.mkdir()
    (inside / "a.png").write_bytes(GOOD_PNG)
    (outside / "b.png").write_bytes(GOOD_PNG)
    os.symlink(outside / "b.png", inside / "link.png")  # a link out of the directory is outside it
    access = MediaAccess(local_root=str(inside))
    assert run(image_bytes(f"file://{inside}/a.png", "x", access)) == GOOD_PNG
    assert run(image_bytes(f"{inside}/a.png", "x", access, bare=True)) == GOOD_PNG  # image_data's path
    for source, words in {f"file://{outside}/b.png": "outside", f"file://{inside}/link.png": "outside",
                          f"file://{inside}/../secret/b.png": "outside", f"file://{inside}/none.png": "no image file"
                          }.items():  # fmt: skip
        with pytest.raises(InputError, match=words):
            run(image_bytes(source, "x", access))
    with pytest.raises(InputError, match="--allowed-local-media-path"):
        run(image_bytes(f"file://{inside}/a.png", "x", MediaAccess()))


def test_http_urls_with_limits() -> None:
    access = MediaAccess(max_bytes=1 << 20, timeout_s=5)
    with ImageServer() as server:
        assert run(image_bytes(server.url("/ok.png"), "x", access)) == GOOD_PNG
        assert run(image_bytes(server.url("/same-host"), "x", access)) == GOOD_PNG
        refused = {"/other-host": "redirects to another host", "/huge": "larger than", "/missing": "HTTP 404"}
        for path, words in refused.items():
            with pytest.raises(InputError, match=words):
                run(image_bytes(server.url(path), "x", access))
        with pytest.raises(InputError, match="took longer than 0.5 s"):
            run(image_bytes(server.url("/slow"), "x", MediaAccess(timeout_s=0.5)))
    with pytest.raises(InputError, match="could not fetch"):
        run(image_bytes(f"http://127.0.0.1:{free_port()}/a.png", "x", access))  # a closed port


def test_image_data_shapes() -> None:
    assert _image_sources(None, 2, True) == [[], []]
    assert _image_sources("a", 1, False) == [[("image_data", "a")]]
    assert _image_sources(["a", "b"], 1, False) == [[("image_data[0]", "a"), ("image_data[1]", "b")]]
    assert _image_sources(["a", ["b", "c"], None], 3, True) == [
        [("image_data[0]", "a")], [("image_data[1][0]", "b"), ("image_data[1][1]", "c")], []]
    with pytest.raises(InputError, match="a list of 2 items"):
        _image_sources(["a"], 2, True)
    with pytest.raises(InputError, match="an image"):
        _image_sources([["a"]], 1, False)


def test_the_flags() -> None:
    from loraplex.frontend.entrypoints.cli import config_from_args
    from loraplex.protocol.config import ConfigError

    config = config_from_args(["--limit-mm-per-prompt", '{"image": 3, "video": 0}', "--allowed-local-media-path", "/m"])
    assert (config.image_limit, config.allowed_local_media_path) == (3, "/m")
    assert ServerConfig().image_limit == 4  # vLLM's default
    for bad, words in (({"video": 1}, "only images"), ({"image": -1}, "int >= 0"), ({"image": True}, "int >= 0")):
        with pytest.raises(ConfigError, match=words):
            ServerConfig(limit_mm_per_prompt=bad)


def test_a_vision_model_without_its_image_processor_does_not_start(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_5_vl", "vision_config": {}, "image_token_id": 5}')
    with pytest.raises(RuntimeError, match="takes images, but its image processor does not load"):
        ImagePipeline.load(str(tmp_path), ServerConfig())
