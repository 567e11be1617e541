"""A request's adapter strength (`lora_scale`): checked at the edge, one value per item, carried to the ranks."""

from __future__ import annotations

import math
from collections.abc import Sequence

from loraplex.protocol.errors import ServerError

MAX_LORA_SCALE = 4.0


def item_scales(scales: Sequence[float | None], lora_names: Sequence[str | None]) -> list[float]:
    """Each item's strength (1 where none is given), or ServerError `invalid_lora_scale` for one outside
    [0, MAX_LORA_SCALE] or given to an item without an adapter."""
    checked = []
    for scale, name in zip(scales, lora_names, strict=True):
        if scale is None:
            checked.append(1.0)
            continue
        if not (isinstance(scale, int | float) and not isinstance(scale, bool) and math.isfinite(scale)):
            raise ServerError(f"invalid_lora_scale: lora_scale must be a number, got {scale!r}", "invalid_lora_scale")
        if not 0.0 <= scale <= MAX_LORA_SCALE:
            raise ServerError(
                f"invalid_lora_scale: lora_scale {scale} is outside [0, {MAX_LORA_SCALE:g}]", "invalid_lora_scale"
            )
        if name is None:
            raise ServerError(
                "invalid_lora_scale: lora_scale scales an adapter's term, but the request names no adapter",
                "invalid_lora_scale",
            )
        checked.append(float(scale))
    return checked
