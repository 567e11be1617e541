"""frontend/multimodal/llama4.py against transformers' Llama 4 processing: the canvas an image is tiled into and the
size it is resized to (the reference's own functions, read from image_processing_llama4.py with a stand-in for the
torchvision module it imports at the top and does not use in them), the tiles cut as the reference's split_to_tiles
cuts them, each image's prompt tokens as Llama4Processor writes them; where torchvision is installed, the whole
output against Llama4ImageProcessor."""

from __future__ import annotations

import importlib.util
import sys
import types

import numpy as np
import pytest
import torch
from loraplex.frontend.errors import InputError
from loraplex.frontend.multimodal.llama4 import (
    PATCH,
    Llama4ImageProcessor,
    Llama4Spec,
    best_canvas,
    expand_llama4,
    image_tokens,
    size_without_distortion,
    supported_canvases,
)

from tests.llama4_vision_models import make_tokenizer, token_ids
from tests.vision_models import test_image as make_image

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
# (height, width): square, wide, tall, tiny, larger than every canvas, exact canvases
SIZES = [(100, 100), (50, 300), (700, 90), (5, 7), (2000, 1500), (672, 336), (336, 1008), (1, 400), (333, 335)]


@pytest.fixture(scope="module")
def reference():
    """transformers.models.llama4.image_processing_llama4, imported with torchvision stood in for when absent."""
    import transformers.image_processing_backends  # noqa: F401  (before the stand-in: it checks for torchvision)

    name = "transformers.models.llama4.image_processing_llama4"
    stand_ins = [] if HAS_TORCHVISION else ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                                            "torchvision.transforms.v2.functional"]  # fmt: skip
    for module in stand_ins:
        sys.modules[module] = types.ModuleType(module)
    try:
        yield importlib.import_module(name)
    finally:
        for module in stand_ins:
            del sys.modules[module]
        if stand_ins:
            del sys.modules[name]


@pytest.mark.parametrize(("max_tiles", "tile"), [(16, 336), (4, 16)])
def test_canvas_and_resize_equal_the_reference(reference, max_tiles: int, tile: int) -> None:
    from transformers.image_utils import SizeDict

    canvases = supported_canvases(max_tiles, tile)
    ref_canvases = reference.find_supported_resolutions(max_tiles, SizeDict(height=tile, width=tile))
    assert canvases == [tuple(c) for c in ref_canvases]
    for to_max in (False, True):
        for height, width in [*SIZES, (tile, tile), (tile + 1, tile - 1)]:
            canvas = best_canvas((height, width), canvases, to_max)
            ref = reference.get_best_fit((height, width), torch.tensor(ref_canvases), resize_to_max_canvas=to_max)
            assert canvas == tuple(ref.tolist()), (height, width, to_max)
            bound = canvas if to_max else (min(max(height, tile), canvas[0]), min(max(width, tile), canvas[1]))
            assert size_without_distortion((height, width), bound) == tuple(
                max(n, 1) for n in reference.get_max_res_without_distortion((height, width), bound))


def test_tiles_are_cut_as_the_reference_cuts_them() -> None:
    """A 32x48 image (width x height) on tiles of 16 fits the 3x2 canvas as it is (no resize): its tiles are the
    reference's split_to_tiles of the bfloat16-normalized canvas, row by row, then the global tile; each hash its
    tile's."""
    from transformers.image_transforms import split_to_tiles

    image = make_image(32, 48, seed=5)
    out = Llama4ImageProcessor(size=16, max_patches=6)(image)
    assert out.aspect == (3, 2) and len(out.tiles) == 7 and out.tile_shape == [1, 3, 16, 16]
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None]  # (1, 3, 48, 32) uint8
    normalized = (pixels.to(torch.bfloat16) * (1 / 255) - 0.5) / 0.5
    want = split_to_tiles(normalized, 3, 2)[0].float()  # (6, 3, 16, 16)
    tiles = [torch.frombuffer(bytearray(t), dtype=torch.float32).view(3, 16, 16) for t in out.tiles]
    assert all(torch.equal(tile, ref) for tile, ref in zip(tiles, want, strict=False))
    assert len(set(out.hashes)) == 7


def test_a_small_image_is_one_tile_padded_black() -> None:
    """A 10x6 image is resized up to the tile's width without distortion (16x9), never past one tile, and padded
    black (-1 once normalized) below."""
    out = Llama4ImageProcessor(size=16, max_patches=4)(make_image(10, 6, seed=1))
    assert out.aspect == (1, 1) and len(out.tiles) == 1
    tile = torch.frombuffer(bytearray(out.tiles[0]), dtype=torch.float32).view(3, 16, 16)
    assert (tile[:, 9:, :] == -1).all() and not (tile[:, 8, :] == -1).all() and not (tile[:, :, 15] == -1).all()


@pytest.mark.parametrize("aspect", [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)])
def test_image_tokens_equal_llama4_processor(aspect: tuple[int, int]) -> None:
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    spec = Llama4Spec(token_ids=token_ids(), tokens_per_tile=4)
    text = Llama4Processor._prompt_split_image(None, aspect, 4)
    assert image_tokens(spec, aspect) == make_tokenizer()(text, add_special_tokens=False)["input_ids"]


def test_expansion_puts_each_tile_on_its_run() -> None:
    ids = token_ids()
    spec = Llama4Spec(token_ids=ids, tokens_per_tile=4)
    processor = Llama4ImageProcessor(size=16, max_patches=4)
    images = [processor(make_image(16, 16)), processor(make_image(32, 16, seed=2))]  # 1 tile; 1x2 and global
    prompt = [7, ids["<|image|>"], 8, ids["<|image|>"], 9]
    expanded, inputs = expand_llama4(prompt, images, spec, "messages[0]")
    assert len(inputs) == 1 + 3
    for image in inputs:
        assert expanded[image.offset : image.offset + 4] == [ids[PATCH]] * 4
        assert expanded[image.offset - 1] != ids[PATCH] and expanded[image.offset + 4] != ids[PATCH]
    assert [i.content_hash for i in inputs] == images[0].hashes + images[1].hashes
    assert expanded[0] == 7 and expanded[-1] == 9 and expanded.count(ids["<|image|>"]) == 2
    with pytest.raises(InputError, match="2 image placeholder"):
        expand_llama4(prompt, images[:1], spec, "messages[0]")


def test_tiles_of_another_size_than_the_vision_model_stop_the_start(tmp_path) -> None:
    import json

    from loraplex.frontend.multimodal.images import ImagePipeline
    from loraplex.protocol.config import ServerConfig

    from tests.llama4_vision_models import VISION, write_preprocessor_config

    make_tokenizer().save_pretrained(tmp_path)
    write_preprocessor_config(tmp_path)
    config = {"model_type": "llama4", "text_config": {"hidden_size": 64}, "vision_config": dict(VISION)}
    (tmp_path / "config.json").write_text(json.dumps(config))
    pipeline = ImagePipeline.load(str(tmp_path), ServerConfig(device="cpu"))
    assert pipeline.modalities == ["text", "image"] and pipeline.spec.tokens_per_tile == 4
    pipeline.close()
    config["vision_config"]["image_size"] = 32
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match="image_size 32"):
        ImagePipeline.load(str(tmp_path), ServerConfig(device="cpu"))


@pytest.mark.skipif(not HAS_TORCHVISION, reason="transformers' Llama4ImageProcessor needs torchvision")
def test_whole_output_equals_llama4_image_processor() -> None:
    from transformers import Llama4ImageProcessor as Reference

    reference = Reference(size={"height": 16, "width": 16}, max_patches=4)
    ours = Llama4ImageProcessor(size=16, max_patches=4)
    for width, height, seed in [(16, 16, 0), (20, 40, 1), (32, 14, 2), (50, 9, 3)]:
        image = make_image(width, height, seed)
        ref = reference(images=[image], return_tensors="pt")
        out = ours(image)
        assert tuple(ref["aspect_ratios"][0].tolist()) == out.aspect
        tiles = torch.stack([torch.frombuffer(bytearray(t), dtype=torch.float32).view(3, 16, 16) for t in out.tiles])
        assert torch.equal(tiles, ref["pixel_values"].float())
