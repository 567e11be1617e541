"""Llama 4's images (model_type `llama4`): transformers' Llama4ImageProcessor and Llama4Processor, reproduced with
PIL and torch (the reference's image processor needs torchvision, which loraplex does not depend on).

An image is resized without distortion (never upsampled past one tile, unless smaller than it) into the best canvas
of ratio_h x ratio_w tiles of `size` pixels (at most max_patches tiles), padded with black at the right and bottom,
rescaled and normalized in bfloat16 as the reference does, and cut into its tiles row by row; an image of more than
one tile gets a global tile too (the whole image resized to one tile), last. Its prompt text: `<|image_start|>`, for
each row of tiles each tile's `<|patch|>` run (`<|tile_x_separator|>` between tiles, `<|tile_y_separator|>` after the
row), then `<|image|>` and the global tile's run (the only one for a one-tile image), `<|image_end|>`. The chat
template leaves one `<|image|>` per image; each becomes that text. Every tile is one ImageInput (the vision model
encodes tiles independently): its own run, its own content hash."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from loraplex.frontend.errors import InputError
from loraplex.protocol.structs import ImageInput

IMAGE_START, IMAGE_END, IMAGE = "<|image_start|>", "<|image_end|>", "<|image|>"
PATCH, TILE_X, TILE_Y = "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>"
TOKENS = (IMAGE_START, IMAGE_END, IMAGE, PATCH, TILE_X, TILE_Y)


@dataclass(frozen=True)
class Llama4Spec:
    """What the frontend needs of a Llama 4 checkpoint: its image tokens' ids and a tile's placeholder count."""

    token_ids: dict[str, int]  # TOKENS -> id
    tokens_per_tile: int  # (tile / patch)**2 / downsample ratio
    tile_size: int = 0  # the vision model's image_size: the image processor's tiles must be as large

    @property
    def image_token_id(self) -> int:
        """The placeholder the chat template leaves, one per image."""
        return self.token_ids[IMAGE]


def llama4_spec(hf: dict[str, Any], model_dir: str) -> Llama4Spec:
    vision = hf.get("vision_config") or {}
    ratio = float(vision.get("pixel_shuffle_ratio", 0.5))
    side = vision.get("image_size", 448) // vision.get("patch_size", 14)
    ids = _special_token_ids(model_dir)
    missing = [token for token in TOKENS if token not in ids]
    if missing:
        raise RuntimeError(f"the llama4 model at {model_dir} takes images, but its tokenizer lacks {missing}")
    return Llama4Spec(token_ids={token: ids[token] for token in TOKENS},
                      tokens_per_tile=side * side // round(1 / ratio**2), tile_size=vision.get("image_size", 448))


def _special_token_ids(model_dir: str) -> dict[str, int]:
    """The added tokens' ids, from tokenizer.json (or tokenizer_config.json's added_tokens_decoder)."""
    ids: dict[str, int] = {}
    try:
        with open(os.path.join(model_dir, "tokenizer.json")) as f:
            ids.update({t["content"]: t["id"] for t in json.load(f).get("added_tokens", [])})
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
            decoder = json.load(f).get("added_tokens_decoder") or {}
        ids.update({t["content"]: int(i) for i, t in decoder.items() if t.get("content") not in ids})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return ids


@dataclass(frozen=True)
class TiledImage:
    tiles: list[bytes]  # each (1, 3, size, size) float32, row-major; the global tile last
    tile_shape: list[int]
    aspect: tuple[int, int]  # (ratio_h, ratio_w) tiles of the canvas
    hashes: list[str]


class Llama4ImageProcessor:
    """preprocessor_config.json's size, max_patches, mean, std and rescale factor; the reference's other defaults."""

    def __init__(self, size: int = 336, max_patches: int = 16, mean=(0.5,) * 3, std=(0.5,) * 3,
                 rescale_factor: float = 1 / 255, resize_to_max_canvas: bool = False):  # fmt: skip
        self.size, self.max_patches = size, max_patches
        self.mean, self.std, self.rescale_factor = list(mean), list(std), rescale_factor
        self.resize_to_max_canvas = resize_to_max_canvas
        self.patch_size = 2  # the smallest side decode.py lets through (vision.min_side)
        self.canvases = supported_canvases(max_patches, size)

    @classmethod
    def load(cls, model_dir: str, spec: Llama4Spec) -> Llama4ImageProcessor:
        try:
            with open(os.path.join(model_dir, "preprocessor_config.json")) as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise RuntimeError(f"the model at {model_dir} takes images, but its preprocessor_config.json does not "
                               f"load: {e}") from e  # fmt: skip
        size = raw.get("size") or {}
        if size.get("height", 336) != size.get("width", 336):
            raise RuntimeError(f"the llama4 image processor's size {size} must be square")
        if size.get("height", 336) != spec.tile_size:
            raise RuntimeError(f"the llama4 image processor's tiles of {size.get('height', 336)} pixels are not the "
                               f"vision model's image_size {spec.tile_size} (preprocessor_config.json, config.json)")
        return cls(size=size.get("height", 336), max_patches=raw.get("max_patches", 16),
                   mean=raw.get("image_mean", (0.5,) * 3), std=raw.get("image_std", (0.5,) * 3),
                   rescale_factor=raw.get("rescale_factor", 1 / 255),
                   resize_to_max_canvas=raw.get("resize_to_max_canvas", False))  # fmt: skip

    def __call__(self, image: Any) -> TiledImage:  # image: an RGB PIL image
        import numpy as np
        import torch

        width, height = image.size
        canvas = best_canvas((height, width), self.canvases, self.resize_to_max_canvas)
        if self.resize_to_max_canvas:
            bound = canvas
        else:  # never upsampled past one tile
            bound = (min(max(height, self.size), canvas[0]), min(max(width, self.size), canvas[1]))
        new_h, new_w = size_without_distortion((height, width), bound)
        resized = _resize(image, new_w, new_h)
        pixels = np.zeros((canvas[0], canvas[1], 3), dtype=np.uint8)  # padded black at the right and bottom
        pixels[:new_h, :new_w] = resized
        ratio_h, ratio_w = canvas[0] // self.size, canvas[1] // self.size
        full = self._normalize(torch.from_numpy(pixels))  # (3, H, W)
        tiles = full.view(3, ratio_h, self.size, ratio_w, self.size).permute(1, 3, 0, 2, 4).reshape(-1, 3, self.size,
                                                                                                   self.size)
        if ratio_h * ratio_w > 1:
            whole = self._normalize(torch.from_numpy(_resize(image, self.size, self.size)))
            tiles = torch.cat((tiles, whole[None]))
        data = [tile.float().contiguous().numpy().tobytes() for tile in tiles]
        return TiledImage(tiles=data, tile_shape=[1, 3, self.size, self.size], aspect=(ratio_h, ratio_w),
                          hashes=[hashlib.sha256(d).hexdigest() for d in data])  # fmt: skip

    def _normalize(self, pixels: Any) -> Any:
        """(H, W, 3) uint8 -> (3, H, W) bfloat16: rescaled and normalized in bfloat16, as the reference."""
        import torch

        x = pixels.permute(2, 0, 1).to(torch.bfloat16) * self.rescale_factor
        mean = torch.tensor(self.mean, dtype=x.dtype)[:, None, None]
        std = torch.tensor(self.std, dtype=x.dtype)[:, None, None]
        return (x - mean) / std


def _resize(image: Any, width: int, height: int) -> Any:
    """(height, width, 3) uint8: bilinear with antialiasing (PIL's, which torchvision's uint8 resize follows)."""
    import numpy as np
    from PIL import Image

    if image.size == (width, height):
        return np.array(image, dtype=np.uint8)
    return np.array(image.resize((width, height), Image.Resampling.BILINEAR), dtype=np.uint8)


def supported_canvases(max_tiles: int, size: int) -> list[tuple[int, int]]:
    """Every (height, width) of h x w tiles with h * w <= max_tiles, grouped by aspect ratio in the order the
    reference first meets each ratio (most tiles first), as its ties are broken by that order."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_tiles, 0, -1):
        for h in sorted(d for d in range(1, count + 1) if count % d == 0):
            by_ratio.setdefault(h / (count // h), []).append((h, count // h))
    return [(h * size, w * size) for pairs in by_ratio.values() for h, w in pairs]


def best_canvas(image_hw: tuple[int, int], canvases: list[tuple[int, int]], to_max: bool) -> tuple[int, int]:
    """The canvas the image fits best: the least upscaling (or the most, to_max), else the least downscaling; of
    equal scales the smallest area (the first of those)."""
    height, width = image_hw
    scales = [min(h / height, w / width) for h, w in canvases]
    up = [s for s in scales if s >= 1]
    chosen = (max(up) if to_max else min(up)) if up else max(scales)
    fits = [c for c, s in zip(canvases, scales, strict=True) if s == chosen]
    return min(fits, key=lambda c: c[0] * c[1])


def size_without_distortion(image_hw: tuple[int, int], bound: tuple[int, int]) -> tuple[int, int]:
    """The largest (height, width) of the image's aspect within bound (each side at least 1)."""
    height, width = image_hw
    scale_h, scale_w = bound[0] / height, bound[1] / width
    if scale_w < scale_h:
        new_h, new_w = min(math.floor(height * scale_w), bound[0]), bound[1]
    else:
        new_h, new_w = bound[0], min(math.floor(width * scale_h), bound[1])
    return max(new_h, 1), max(new_w, 1)


def image_tokens(spec: Llama4Spec, aspect: tuple[int, int]) -> list[int]:
    """The prompt tokens one image of `aspect` tiles takes (Llama4Processor's text for it)."""
    ids, run = spec.token_ids, [spec.token_ids[PATCH]] * spec.tokens_per_tile
    out = [ids[IMAGE_START]]
    ratio_h, ratio_w = aspect
    if ratio_h * ratio_w > 1:
        for _ in range(ratio_h):
            for x in range(ratio_w):
                out += run + ([ids[TILE_X]] if x < ratio_w - 1 else [])
            out.append(ids[TILE_Y])
    return out + [ids[IMAGE]] + run + [ids[IMAGE_END]]


def expand_llama4(input_ids: list[int], images: list[TiledImage], spec: Llama4Spec, what: str
                  ) -> tuple[list[int], list[ImageInput]]:  # fmt: skip
    """input_ids with each image's `<|image|>` replaced by its tokens; one ImageInput per tile."""
    token = spec.image_token_id
    at = [i for i, t in enumerate(input_ids) if t == token]
    if len(at) != len(images):
        raise InputError(f"{what}: {len(at)} image placeholder token(s) (id {token}, {IMAGE}) for {len(images)} "
                         "image(s): give one per image, where it goes")  # fmt: skip
    patch = spec.token_ids[PATCH]
    expanded: list[int] = []
    inputs: list[ImageInput] = []
    start = 0
    for pos, image in zip(at, images, strict=True):
        expanded += input_ids[start:pos]
        tokens = image_tokens(spec, image.aspect)
        runs = [i for i, t in enumerate(tokens) if t == patch and tokens[i - 1] != patch]  # each tile's run
        for run, data, digest in zip(runs, image.tiles, image.hashes, strict=True):
            inputs.append(ImageInput(offset=len(expanded) + run, num_tokens=spec.tokens_per_tile, content_hash=digest,
                                     pixel_values=data, shape=image.tile_shape, grid_thw=[]))  # fmt: skip
        expanded += tokens
        start = pos + 1
    return expanded + input_ids[start:], inputs
