from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: the pages (or blocks, tiles) that hold `a` items `b` to a page."""
    return -(-a // b)
