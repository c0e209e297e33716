"""LRU order of the pool's objects and the choice of eviction victims on one segment.

`PoolMetadata` (metadata.py) owns one `Lru` and keeps it in step with its objects; this
module knows the records (objects.py) but nothing of the metadata, so the policy reads
and tests alone.

A segment is evicted when its use passes the high watermark (down to the low one), or
when a put needs a contiguous range it does not have (until one fits). Victims are
replicas on that segment, least recently used object first (a get refreshes an object;
exists does not), skipping:
  - objects under a read lease (a reader may be copying their bytes right now);
  - pending objects (being written; they are not in the LRU until put_end).
  - objects an SSD spill is copying (tiers/ssd_orders.py), until its order ends;
  - replicas a soft pin holds (`keep`, pins/book.py), within the pins' bound.
An object that loses its last replica disappears from the pool; one that keeps another
replica stays visible with fewer copies.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping

from services.cache_master.metadata.objects import PoolObject, Segment


class Lru:
    """Keys of complete objects, least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def add(self, key: str) -> None:
        """A newly visible object: the most recently used."""
        self._order[key] = None

    def touch(self, key: str) -> None:
        self._order.move_to_end(key)

    def discard(self, key: str) -> None:
        self._order.pop(key, None)

    def evict(
        self,
        segment: Segment,
        objects: Mapping[str, PoolObject],
        now: float,
        low_watermark: float,
        need: int = 0,
        *,
        first: Callable[[PoolObject], bool] | None = None,
        keep: Callable[[PoolObject], bool] | None = None,
    ) -> list[PoolObject]:
        """Free the bytes of `segment`'s replicas of the oldest unleased objects.

        `need` > 0: stop as soon as a free range of `need` bytes exists. Otherwise stop
        when use is at or under `low_watermark`. Walks the order from the oldest without
        changing it; the caller then forgets each returned object's replica on
        `segment` (its bytes are already free) and drops the key of one left with none.
        `first`: objects it accepts are evicted before any other (those with an SSD copy,
        tiers/ssd_orders.py: evicting them loses nothing), then the walk goes on over the rest.
        `keep`: objects it accepts are never evicted here (pinned, pins/book.py).
        """
        alloc = segment.allocator

        def done() -> bool:
            if need > 0:
                return alloc.largest_free >= alloc.aligned(need)
            return segment.use <= low_watermark

        victims: list[PoolObject] = []
        if done():
            return victims
        taken: set[str] = set()
        for accept in (first, None) if first is not None else (None,):
            for key in self._order:
                obj = objects.get(key)
                replica = obj.on(segment.store_id) if obj is not None else None
                if obj is None or replica is None or obj.leased(now) or key in taken:
                    continue
                if obj.spilling_until > now or (accept is not None and not accept(obj)):
                    continue
                if keep is not None and keep(obj):
                    continue
                alloc.free(replica.offset)
                victims.append(obj)
                taken.add(key)
                if done():
                    return victims
        return victims
