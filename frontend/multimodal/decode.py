"""Encoded image bytes to an RGB PIL image, or an InputError naming the part: formats outside FORMATS, files PIL
cannot identify or that end early, images whose header claims more than MAX_PIXELS (checked before any pixel is
decoded, so a small file cannot make the server allocate gigabytes) and images smaller than the model can take.
Blocking: runs on the image pool's threads (frontend/multimodal/images.py)."""

from __future__ import annotations

import io
from typing import Any

from loraplex.frontend.errors import InputError

FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP"})
MAX_PIXELS = 40_000_000  # a 20k x 20k image (400 M pixels) is refused from its header alone
MAX_SIDE = 16_384


def decode_image(data: bytes, what: str, min_side: int = 2) -> Any:  # -> PIL.Image.Image in mode RGB
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as probe:
            kind, (width, height) = probe.format, probe.size
            _check_size(width, height, what, min_side)
            if kind not in FORMATS:
                raise InputError(f"{what}: unsupported image format {kind}: give {', '.join(sorted(FORMATS))}")
            probe.verify()  # the file's structure and checksums, without decoding the pixels
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return image.convert("RGB")
    except InputError:
        raise
    except UnidentifiedImageError as e:
        raise InputError(f"{what}: not an image of a supported format ({', '.join(sorted(FORMATS))})") from e
    except Image.DecompressionBombError as e:
        raise InputError(f"{what}: the image is too large ({e})") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # PIL's errors for a truncated or corrupt file
        raise InputError(f"{what}: the image file is corrupt or truncated ({e})") from e


def _check_size(width: int, height: int, what: str, min_side: int) -> None:
    if width * height > MAX_PIXELS or max(width, height) > MAX_SIDE:
        raise InputError(f"{what}: the image is too large ({width}x{height} pixels; at most {MAX_PIXELS} pixels "
                         f"and {MAX_SIDE} a side)")  # fmt: skip
    if min(width, height) < min_side:
        raise InputError(f"{what}: the image is too small ({width}x{height} pixels; each side at least {min_side})")
