"""What the frontend knows of a vision-language model, from its config.json: whether it takes images at all, its
image placeholder token, how many placeholders an image's grid makes (the vision tower merges merge x merge patches
into one token), and whether it positions tokens with Qwen-VL's M-RoPE (protocol/mrope.py). The image processor is
the checkpoint's own (transformers' AutoImageProcessor on preprocessor_config.json)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loraplex.frontend.errors import InputError

# Multimodal checkpoints whose workers serve the language model alone (MODELS.md): their images are refused.
TEXT_ONLY_TYPES = frozenset({"qwen3_5", "qwen3_5_moe", "mistral3"})
# Checkpoints whose processor wraps an image's placeholders in begin and end tokens (config keys)
WRAPPED_TYPES = {"gemma4": ("boi_token_id", "eoi_token_id")}
MROPE_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})
NO_IMAGES = "this model takes no images"


@dataclass(frozen=True)
class VisionSpec:
    image_token_id: int
    merge_size: int  # spatial_merge_size: an image of grid (t, h, w) patches takes t*h*w / merge**2 tokens
    mrope: bool  # Qwen-VL's 3-row rotary positions
    begin_token_id: int | None = None  # Gemma 4: each image's run is begin, placeholders, end (prompt.py)
    # A family that lays images out its own way (Gemma 3: frontend/multimodal/gemma3.py): the token a prompt holds
    # per image when it is not image_token_id, the token ending the run (Gemma 4's too), a fixed count of
    # placeholders an image, the image processor's own arguments, the tokenizer, and the expansion (prompt.py's
    # otherwise).
    prompt_token_id: int | None = None
    end_token_id: int | None = None
    tokens_per_image: int = 0  # 0: from the image's grid
    processor_kwargs: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = field(default=None, compare=False, repr=False)
    expand: Callable[..., Any] | None = field(default=None, compare=False, repr=False)


def generic_vision_spec(hf: dict[str, Any]) -> VisionSpec | None:
    """The VisionSpec of a family whose images are one run of placeholders from the image's grid (Qwen-VL), wrapped
    in begin/end tokens where WRAPPED_TYPES says (Gemma 4); None when the model takes no images."""
    vision = hf.get("vision_config")
    token_id = hf.get("image_token_id", hf.get("image_token_index"))
    if not isinstance(vision, dict) or not isinstance(token_id, int) or hf.get("model_type") in TEXT_ONLY_TYPES:
        return None
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    rope = [c.get(key) for c in (hf, text) for key in ("rope_parameters", "rope_scaling")]
    has_section = any(isinstance(r, dict) and r.get("mrope_section") for r in rope)
    begin, end = (hf.get(key) for key in WRAPPED_TYPES.get(hf.get("model_type"), ("", "")))
    if hf.get("model_type") in WRAPPED_TYPES and not (isinstance(begin, int) and isinstance(end, int)):
        return None
    return VisionSpec(image_token_id=token_id, merge_size=int(vision.get("spatial_merge_size", 1)),
                      mrope=has_section or hf.get("model_type") in MROPE_TYPES, begin_token_id=begin,
                      end_token_id=end)  # fmt: skip


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the model's image processor made it."""

    pixel_values: bytes  # float32, row-major
    shape: list[int]
    grid_thw: list[int]
    num_tokens: int
    content_hash: str  # sha256 of the pixels and the grid: equal only for images the encoder sees alike


def load_image_processor(model_dir: str) -> Any:
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(model_dir)
    except (OSError, ValueError) as e:  # the server cannot serve its images: it does not start
        raise RuntimeError(f"the model at {model_dir} takes images, but its image processor does not load "
                           f"(preprocessor_config.json): {e}") from e  # fmt: skip


def process_image(processor: Any, spec: VisionSpec, image: Any, what: str) -> ProcessedImage:
    """One RGB PIL image through the processor. Blocking (torch/numpy work): the image pool's threads run it."""
    import numpy as np

    try:
        out = processor(images=[image], return_tensors="np", **spec.processor_kwargs)
    except ValueError as e:  # e.g. Qwen-VL's aspect ratio over 200
        raise InputError(f"{what}: the model's image processor refused the image ({e})") from e
    if "image_position_ids" in out:  # Gemma 4: patches padded to the budget, each with its (x, y)
        pixels, grid, num_tokens = unpadded_patches(out)
    else:
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        grid = [int(x) for x in out["image_grid_thw"][0]] if "image_grid_thw" in out else []
        num_tokens = (grid[0] * grid[1] * grid[2]) // spec.merge_size**2 if grid else \
            spec.tokens_per_image or int(pixels.shape[0])  # fmt: skip
    digest = hashlib.sha256(pixels.tobytes())
    digest.update(np.asarray(grid, dtype=np.int64).tobytes())
    return ProcessedImage(pixel_values=pixels.tobytes(), shape=list(pixels.shape), grid_thw=grid,
                          num_tokens=num_tokens, content_hash=digest.hexdigest())  # fmt: skip


def unpadded_patches(out: Any) -> tuple[Any, list[int], int]:
    """Gemma 4's processor output for one image -> (its real patches (h * w, patch dim) float32, row-major; the grid
    (1, h, w) in patches; its soft tokens). The padding patches (position (-1, -1)) change nothing the tower
    computes: they are masked out of its attention and its pooling."""
    import numpy as np

    positions = np.asarray(out["image_position_ids"][0])  # (max patches, 2): (x, y), -1 for padding
    real = (positions != -1).all(-1)
    width, height = int(positions[real, 0].max()) + 1, int(positions[real, 1].max()) + 1
    pixels = np.ascontiguousarray(np.asarray(out["pixel_values"][0])[real], dtype=np.float32)
    return pixels, [1, height, width], int(out["num_soft_tokens_per_image"][0])


def min_side(processor: Any) -> int:
    """The smallest side an image may have: one patch (a 1x1 image says nothing the model can see)."""
    return max(2, int(getattr(processor, "patch_size", 2) or 2))


def no_images_error() -> InputError:
    return InputError(NO_IMAGES)
