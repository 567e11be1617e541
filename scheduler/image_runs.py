"""Where a chunked prefill may end in a prompt whose images' placeholder runs attend both ways (Gemma 3,
WorkerReady.images_whole): never inside a run, whose first tokens would otherwise be computed without the keys after
them. A prefix-cache hit may still end inside a run: the pages it reuses were written by a pass that held the whole
run (and their keys hold the image's content hash), so the rest of the run attends to exactly those keys."""

from __future__ import annotations

from collections.abc import Sequence

from loraplex.protocol.structs import ImageInput


def whole_image_len(images: Sequence[ImageInput], start: int, num_new: int, alone: bool) -> int:
    """The tokens a pass from prompt position `start` takes, at most `num_new` (its budget), ending outside every
    image's run: cut back to the run's start, or, when the run begins at (or before) `start`, taken through its end
    if the pass runs `alone` (its whole budget free: a run longer than the budget goes as a long prompt goes), else
    none this step."""
    end = start + num_new
    for image in images:
        first, last = image.offset, image.offset + image.num_tokens
        if first < end < last:
            if first > start:
                return first - start
            return last - start if alone else 0
    return num_new
