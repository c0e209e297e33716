"""The free list of a worker's paged KV pool."""

from __future__ import annotations

from collections.abc import Iterable


class PageAllocator:
    """Hands out page indices in [0, num_pages) of one KV pool.

    Contract:
    - `alloc(n)` returns n distinct free pages, or None when fewer than n are
      free; it never hands out part of a request;
    - `free(pages)` returns pages to the pool; freeing a page that is not
      allocated (double free, or out of range) raises ValueError and changes
      nothing, so a bookkeeping bug shows up where it happens instead of as
      two sequences sharing a page;
    - both are O(n) in the pages moved, independent of the pool size.

    Freed pages are reused first (LIFO): recently touched pages are more
    likely to be warm in the caches.
    """

    __slots__ = ("_free", "_is_free", "num_pages")

    def __init__(self, num_pages: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        # A stack popped from the end: the first alloc gets 0, 1, 2, ...
        self._free = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        seen: set[int] = set()
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page {p} is outside the pool of {self.num_pages}")
            if self._is_free[p] or p in seen:
                raise ValueError(f"page {p} is already free (double free)")
            seen.add(p)
        for p in pages:
            self._is_free[p] = 1
        # Reversed so that the first page freed is the first one handed out again.
        self._free.extend(reversed(pages))

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])
