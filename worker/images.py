"""A pass's images -> the embedding rows that replace their placeholder tokens.

ForwardReq.images holds the images whose placeholder runs overlap the pass's tokens (offsets in the whole prompt);
a chunked prefill may cut a run, so each image is encoded whole and only the rows inside the pass are kept. Every
image of the batch goes through the vision tower in one call (each attends within itself); an image two requests
share (one content_hash) is encoded once. Each image is checked on the host first: a bad one fails the batch with a
BatchError, never a shape error inside the tower."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from loraplex.protocol.structs import ForwardReq, ImageInput
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.model.config import VisionConfig

if TYPE_CHECKING:
    from loraplex.worker.lora.manager import LoRAManager


@dataclass(frozen=True)
class PassImages:
    rows: torch.Tensor  # (image tokens,) their rows in the pass's flat token batch
    embeds: torch.Tensor  # (image tokens, hidden) in the same order


def pass_images(model, vision: VisionConfig | None, reqs: list[ForwardReq], device: torch.device,
                lora: LoRAManager | None = None) -> PassImages | None:  # fmt: skip
    """The image rows of this pass (None: it has none). `model.encode_images(pixels, grids)` is the tower; with
    `lora` holding tower adapters (--enable-tower-connector-lora), each image is encoded with its request's adapter
    (an image shared by requests on different adapters, once for each)."""
    if not any(req.images for req in reqs):
        return None
    if vision is None:
        raise BatchError("the batch carries images but this model has no vision tower")
    tower = lora.tower if lora is not None else None
    unique: dict[tuple, int] = {}  # (content_hash, the tower adapter and strength) -> index among those encoded
    encoded: list[ImageInput] = []
    adapters: list[tuple[dict, float]] = []  # per image encoded: its tower weights ({}: none) and strength
    wanted: list[tuple[int, int, int, int]] = []  # (first batch row, image index, first image row, count)
    token_start = 0
    for i, req in enumerate(reqs):
        start, end = req.num_cached_tokens, req.num_cached_tokens + len(req.input_ids)
        for image in req.images:
            _check_image(i, image, vision)
            lo, hi = max(image.offset, start), min(image.offset + image.num_tokens, end)
            if lo >= hi:
                continue  # no placeholder of it in this pass
            placeholders = req.input_ids[lo - start : hi - start]
            if any(t != vision.image_token_id for t in placeholders):
                raise BatchError(f"request {i}: the image at {image.offset} covers tokens that are not its "
                                 f"placeholder {vision.image_token_id}")  # fmt: skip
            weights = lora.tower_weights(req.slot) if tower is not None else {}
            scale = req.lora_scale if weights else 1.0
            index = unique.setdefault((image.content_hash, id(weights) if weights else None, scale), len(encoded))
            if index == len(encoded):
                encoded.append(image)
                adapters.append((weights, scale))
            wanted.append((token_start + lo - start, index, lo - image.offset, hi - lo))
        token_start += len(req.input_ids)
    if not wanted:
        return None
    pixels = torch.cat([_pixels(image) for image in encoded]).to(device)
    if tower is not None:
        tower.begin([math.prod(image.grid_thw) for image in encoded], [w for w, _ in adapters],
                    [scale for _, scale in adapters], device)  # fmt: skip
    try:
        out = model.encode_images(pixels, [image.grid_thw for image in encoded])  # (rows of every image, hidden)
    finally:
        if tower is not None:
            tower.end()
    per_image = out.split([image.num_tokens for image in encoded])
    rows = torch.cat([torch.arange(first, first + count) for first, _, _, count in wanted]).to(device)
    embeds = torch.cat([per_image[index][offset : offset + count] for _, index, offset, count in wanted])
    return PassImages(rows=rows, embeds=embeds)


def _pixels(image: ImageInput) -> torch.Tensor:
    return torch.frombuffer(bytearray(image.pixel_values), dtype=torch.float32).view(*image.shape)


def _check_image(i: int, image: ImageInput, vision: VisionConfig) -> None:
    c = vision
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
