"""A pass's images -> the embedding rows that replace their placeholder tokens.

ForwardReq.images holds the images whose placeholder runs overlap the pass's tokens (offsets in the whole prompt);
a chunked prefill may cut a run, and a prefix-cache hit may end inside one, so each image is encoded whole (once: its
embeddings are kept for the passes after) and only the rows inside the pass are taken. Every image of the batch goes
through the vision tower in one call (each attends within itself); an image two requests share (one content_hash) is
encoded once. Each image is checked on the host first: a bad one fails the batch with a BatchError, never a shape
error inside the tower."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from loraplex.protocol.structs import ForwardReq, ImageInput
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.model.config import Llama4VisionConfig, SiglipVisionConfig, VisionConfig
from loraplex.worker.model.gemma3_vision import check_image_shape

if TYPE_CHECKING:
    from loraplex.worker.lora.manager import LoRAManager


@dataclass(frozen=True)
class PassImages:
    rows: torch.Tensor  # (image tokens,) their rows in the pass's flat token batch
    embeds: torch.Tensor  # (image tokens, hidden) in the same order; Qwen3-VL: (image tokens, 1 + deepstack, hidden)


class ImageEncoder:
    """A runner's images -> rows. An image is encoded on the pass that first takes rows of it and its embeddings kept
    for the passes after: those of an image a chunked prefill cuts (its later rows), and those of a whole image too,
    because a request whose prefix-cache hit ends inside the image's placeholder run takes its rows past the hit, and
    another request may send the same image a pass later (without them, each such pass ran the tower again). Kept:
    up to `max_kept` images whose rows a pass still has to take (`partial`, oldest dropped first; a request aborted
    mid-image leaves its entry to age out) and up to `max_done` images taken whole (`done`, least recently used
    dropped first)."""

    def __init__(self, model, vision: VisionConfig | Llama4VisionConfig | None, device: torch.device,
                 lora: LoRAManager | None = None, max_kept: int = 16, max_done: int = 16):  # fmt: skip
        self.model, self.vision, self.device, self.lora = model, vision, device, lora
        self.max_kept, self.max_done = max_kept, max_done
        # (content_hash, tower adapter, strength) -> its rows; a key is in one of the two at most
        self.partial: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.done: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.num_encoded = 0  # images through the tower (for tests and logs)

    def rows(self, reqs: list[ForwardReq]) -> PassImages | None:
        """The image rows of this pass (None: it has none). `model.encode_images(pixels, grids)` is the tower; with
        `lora` holding tower adapters (--enable-tower-connector-lora), each image is encoded with its request's
        adapter (an image shared by requests on different adapters, once for each)."""
        if not any(req.images for req in reqs):
            return None
        vision, lora = self.vision, self.lora
        if vision is None:
            raise BatchError("the batch carries images but this model has no vision tower")
        tower = lora.tower if lora is not None else None
        keys: list[tuple] = []  # (content_hash, the tower adapter's lora_id or -1, strength) of each image taken
        images: dict[tuple, ImageInput] = {}
        adapters: dict[tuple, tuple[dict, float]] = {}  # its tower weights ({}: none) and strength
        wanted: list[tuple[int, tuple, int, int]] = []  # (first batch row, image key, first image row, count)
        finished: set[tuple] = set()  # images whose last row this pass takes
        token_start = 0
        for i, req in enumerate(reqs):
            start, end = req.num_cached_tokens, req.num_cached_tokens + len(req.input_ids)
            for image in req.images:
                _check_image(i, image, vision)
                lo, hi = max(image.offset, start), min(image.offset + image.num_tokens, end)
                if lo >= hi:
                    continue  # no placeholder of it in this pass
                if any(t != vision.image_token_id for t in req.input_ids[lo - start : hi - start]):
                    raise BatchError(f"request {i}: the image at {image.offset} covers tokens that are not its "
                                     f"placeholder {vision.image_token_id}")  # fmt: skip
                weights = lora.tower_weights(req.slot) if tower is not None else {}
                scale = req.lora_scale if weights else 1.0
                key = (image.content_hash, lora.slot_lora_ids[req.slot] if weights else -1, scale)
                if key not in images:
                    keys.append(key)
                    images[key], adapters[key] = image, (weights, scale)
                if hi == image.offset + image.num_tokens:
                    finished.add(key)
                wanted.append((token_start + lo - start, key, lo - image.offset, hi - lo))
            token_start += len(req.input_ids)
        if not wanted:
            return None
        embeds = {key: self.partial.get(key, self.done.get(key)) for key in keys}
        embeds.update(self._encode([key for key, rows in embeds.items() if rows is None], images, adapters))
        for key in keys:  # an image a pass takes the last rows of is done; else a later pass takes more of it
            self.partial.pop(key, None)
            self.done.pop(key, None)
            (self.done if key in finished else self.partial)[key] = embeds[key]
        for kept, limit in ((self.partial, self.max_kept), (self.done, self.max_done)):
            while len(kept) > limit:
                kept.popitem(last=False)
        rows = torch.cat([torch.arange(first, first + count) for first, _, _, count in wanted]).to(self.device)
        out = torch.cat([embeds[key][offset : offset + count] for _, key, offset, count in wanted])
        return PassImages(rows=rows, embeds=out)

    def _encode(self, keys: list[tuple], images: dict[tuple, ImageInput], adapters: dict[tuple, tuple[dict, float]]
                ) -> dict[tuple, torch.Tensor]:  # fmt: skip
        """Every image of `keys` through the tower in one call: key -> its (num_tokens, hidden) rows."""
        if not keys:
            return {}
        self.num_encoded += len(keys)
        tower = self.lora.tower if self.lora is not None else None
        pixels = torch.cat([_pixels(images[key]) for key in keys]).to(self.device)
        if tower is not None:
            tower.begin([self._num_patches(images[key]) for key in keys], [adapters[key][0] for key in keys],
                        [adapters[key][1] for key in keys], self.device)  # fmt: skip
        try:
            out = self.model.encode_images(pixels, [images[key].grid_thw for key in keys])  # (rows of all, hidden)
        finally:
            if tower is not None:
                tower.end()
        return dict(zip(keys, out.split([images[key].num_tokens for key in keys]), strict=True))

    def _num_patches(self, image: ImageInput) -> int:
        """The rows the tower's adapters count for the image (worker/lora/tower.py's patch_counts)."""
        if isinstance(self.vision, SiglipVisionConfig):  # Gemma 3: every image the same square of patches
            return self.vision.patches_per_side**2
        return math.prod(image.grid_thw)  # Llama 4's tile (no grid): its one leading row


def _pixels(image: ImageInput) -> torch.Tensor:
    return torch.frombuffer(bytearray(image.pixel_values), dtype=torch.float32).view(*image.shape)


def _check_image(i: int, image: ImageInput, vision: VisionConfig | Llama4VisionConfig | SiglipVisionConfig) -> None:
    if isinstance(vision, Llama4VisionConfig):  # one tile of a Llama 4 image
        problem = vision.image_problem(image.shape, image.num_tokens, len(image.pixel_values))
        if problem is not None:
            raise BatchError(f"request {i}: {problem}")
        return
    c = vision
    if isinstance(c, SiglipVisionConfig):  # a fixed-size image (Gemma 3): (1, channels, size, size), no grid
        problem = check_image_shape(image.shape, c)
        if not problem and len(image.pixel_values) != 4 * math.prod(image.shape):
            problem = f"image pixel_values hold {len(image.pixel_values)} bytes, not float32 of shape {image.shape}"
        if not problem and image.num_tokens != c.mm_tokens_per_image:
            problem = f"an image has {c.mm_tokens_per_image} placeholder tokens, not {image.num_tokens}"
        if problem:
            raise BatchError(f"request {i}: {problem}")
        return
    patch_dim = c.in_channels * c.temporal_patch_size * c.patch_size**2
    if len(image.grid_thw) != 3 or any(n <= 0 for n in image.grid_thw):
        raise BatchError(f"request {i}: image grid {image.grid_thw} is not 3 positive sizes (t, h, w)")
    t, h, w = image.grid_thw
    if h % c.spatial_merge_size or w % c.spatial_merge_size:
        raise BatchError(f"request {i}: image grid {image.grid_thw} does not divide into {c.spatial_merge_size}x"
                         f"{c.spatial_merge_size} merge blocks")  # fmt: skip
    if list(image.shape) != [t * h * w, patch_dim]:
        raise BatchError(f"request {i}: image pixel_values of shape {image.shape}, expected {[t * h * w, patch_dim]} "
                         f"for grid {image.grid_thw}")  # fmt: skip
    if len(image.pixel_values) != 4 * math.prod(image.shape):
        raise BatchError(f"request {i}: image pixel_values hold {len(image.pixel_values)} bytes, not float32 of "
                         f"shape {image.shape}")  # fmt: skip
    if image.num_tokens != t * h * w // c.spatial_merge_size**2:
        raise BatchError(f"request {i}: an image of grid {image.grid_thw} has "
                         f"{t * h * w // c.spatial_merge_size**2} placeholder tokens, not {image.num_tokens}")
