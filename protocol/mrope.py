"""Qwen-VL's multimodal rotary positions (M-RoPE): three position rows (time, height, width) for a prompt whose
images stand as runs of placeholder tokens.

A text token takes the same position in all three rows, one past the previous token's largest. An image's run of
t*h*w merged patches takes (start + frame, start + row, start + column) over its grid, and the text after it goes on
from start + max(h, w) (not start + t*h*w): an image costs fewer positions than tokens. A token generated after the
prompt at index i sits at i + delta in every row, delta = (largest prompt position + 1) - prompt length.
Pure Python: the frontend computes them once per prompt and the scheduler slices them per pass.
"""

from __future__ import annotations


def mrope_positions(
    input_ids: list[int], image_token_id: int, grids: list[list[int]], spatial_merge_size: int
) -> tuple[list[list[int]], int]:
    """(rows, delta): rows[k][i] is token i's position in row k (0 time, 1 height, 2 width). grids[j] is the j-th
    image's (t, h, w) in patches, before merging; its run of image_token_id is t*h*w / spatial_merge_size**2 long."""
    rows: list[list[int]] = [[], [], []]
    images = iter(grids)
    next_pos = 0  # the position the next text token takes
    i = 0
    while i < len(input_ids):
        if input_ids[i] != image_token_id:
            for row in rows:
                row.append(next_pos)
            next_pos += 1
            i += 1
            continue
        grid = next(images, None)
        if grid is None:
            raise ValueError(f"more runs of the image token {image_token_id} than the {len(grids)} images given")
        t, h, w = grid[0], grid[1] // spatial_merge_size, grid[2] // spatial_merge_size
        run = t * h * w
        if input_ids[i : i + run] != [image_token_id] * run:
            raise ValueError(f"an image of grid {list(grid)} needs {run} placeholder tokens at {i}")
        for frame in range(t):
            for y in range(h):
                for x in range(w):
                    rows[0].append(next_pos + frame)
                    rows[1].append(next_pos + y)
                    rows[2].append(next_pos + x)
        next_pos += max(h, w)
        i += run
    if next(images, None) is not None:
        raise ValueError(f"{len(grids)} images given for fewer runs of the image token {image_token_id}")
    return rows, next_pos - len(input_ids)
