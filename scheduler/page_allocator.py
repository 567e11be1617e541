"""PageAllocator: the free list of KV cache pages. Pages are plain ints; the workers own the tensors behind them."""

from __future__ import annotations

from collections.abc import Iterable


class PageError(RuntimeError):
    """A page freed twice, or a page this allocator never handed out."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free_page_ids = list(range(num_pages - 1, -1, -1))  # popped from the end: low ids first
        self._is_allocated = [False] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free_page_ids)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_pages

    def can_allocate(self, num_pages: int) -> bool:
        return 0 <= num_pages <= self.num_free

    def allocate(self, num_pages: int) -> list[int]:
        if not self.can_allocate(num_pages):
            raise PageError(f"cannot allocate {num_pages} pages: {self.num_free} free of {self.num_pages}")
        page_ids = [self._free_page_ids.pop() for _ in range(num_pages)]
        for page_id in page_ids:
            self._is_allocated[page_id] = True
        return page_ids

    def free(self, page_ids: Iterable[int]) -> None:
        page_ids = list(page_ids)
        # Check everything before changing anything, so a bad call leaves the allocator as it was.
        if len(set(page_ids)) != len(page_ids):
            raise PageError(f"page ids repeated in one free: {sorted(page_ids)}")
        for page_id in page_ids:
            if not 0 <= page_id < self.num_pages:
                raise PageError(f"page {page_id} is not one of this allocator's {self.num_pages} pages")
            if not self._is_allocated[page_id]:
                raise PageError(f"page {page_id} freed twice")
        for page_id in page_ids:
            self._is_allocated[page_id] = False
            self._free_page_ids.append(page_id)
