"""An offset allocator for one store segment: best fit, free ranges coalesced on free.

The master never touches segment bytes; it only decides which byte ranges of a store's
segment hold which object. Ranges are aligned to `alignment` bytes (sizes are rounded
up), so every object starts on an aligned offset and the transfer engine moves whole
cache lines.

    segment:  [ used A ][ free 3 ][ used B ][ free 5 ][ used C ][ free 2 ]
    free B:   [ used A ][ free 3 + 4 + 5 = 12      ][ used C ][ free 2 ]

Free ranges are kept twice: by start (sorted starts + a start -> length dict, for
neighbour lookups when coalescing) and by (length, start) (sorted, for best fit in
O(log n) comparisons). Best fit keeps large free ranges whole for large objects, which
is what bounds fragmentation under the mixed 4 KiB / 1 MiB traffic a KV pool sees.
Pure Python, no I/O; unit-tested in tests/pool/test_allocator.py.
"""

from __future__ import annotations

import bisect


class AllocationError(ValueError):
    """An `allocate_at`/`free` that does not match the allocator's state."""


class OffsetAllocator:
    """Allocates aligned byte ranges in `[0, capacity)`.

    Contract:
      - `allocate(size)` returns an offset such that `[offset, offset + aligned(size))`
        overlaps no other live allocation, or None when no free range fits;
      - `allocate_at(offset, size)` claims a given range (used when a store re-mounts
        and reports what it holds) or raises AllocationError if any byte is taken;
      - `free(offset)` releases the allocation that starts at `offset` and merges it with
        free neighbours, so freeing everything leaves exactly one free range.
    """

    def __init__(self, capacity: int, alignment: int = 64):
        if capacity <= 0:
            raise ValueError(f"capacity: must be > 0, got {capacity}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment: must be a power of two, got {alignment}")
        self.alignment = alignment
        # Only whole aligned units are usable.
        self.capacity = capacity - capacity % alignment
        self._starts: list[int] = []
        self._free: dict[int, int] = {}
        self._by_size: list[tuple[int, int]] = []
        self._used: dict[int, int] = {}
        self.used_bytes = 0
        if self.capacity:
            self._add_free(0, self.capacity)

    def aligned(self, size: int) -> int:
        return max(self.alignment, -(-size // self.alignment) * self.alignment)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def free_ranges(self) -> int:
        return len(self._starts)

    def __len__(self) -> int:
        return len(self._used)

    def allocate(self, size: int) -> int | None:
        if size < 0:
            raise ValueError(f"size: must be >= 0, got {size}")
        need = self.aligned(size)
        i = bisect.bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        length, start = self._by_size[i]
        self._remove_free(start)
        if length > need:
            self._add_free(start + need, length - need)
        self._used[start] = need
        self.used_bytes += need
        return start

    def allocate_at(self, offset: int, size: int) -> None:
        need = self.aligned(size)
        if offset < 0 or offset % self.alignment or offset + need > self.capacity:
            raise AllocationError(f"range {offset}+{size} is not an aligned range of the segment")
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            raise AllocationError(f"range {offset}+{size} is taken")
        start = self._starts[i]
        length = self._free[start]
        if offset + need > start + length:
            raise AllocationError(f"range {offset}+{size} is taken")
        self._remove_free(start)
        if offset > start:
            self._add_free(start, offset - start)
        if start + length > offset + need:
            self._add_free(offset + need, start + length - offset - need)
        self._used[offset] = need
        self.used_bytes += need

    def free(self, offset: int) -> int:
        """Release the allocation at `offset`; return the bytes released."""
        length = self._used.pop(offset, None)
        if length is None:
            raise AllocationError(f"no allocation starts at {offset}")
        self.used_bytes -= length
        start, end = offset, offset + length
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == end:  # right neighbour is free
            end += self._free[end]
            self._remove_free(self._starts[i])
        if i > 0:
            left = self._starts[i - 1]
            if left + self._free[left] == start:  # left neighbour is free
                start = left
                self._remove_free(left)
        self._add_free(start, end - start)
        return length

    def _add_free(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._free[start] = length
        bisect.insort(self._by_size, (length, start))

    def _remove_free(self, start: int) -> None:
        length = self._free.pop(start)
        del self._starts[bisect.bisect_left(self._starts, start)]
        del self._by_size[bisect.bisect_left(self._by_size, (length, start))]
