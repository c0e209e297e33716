"""LRU eviction of one segment: the policy, apart from the bookkeeping it acts on.

A segment is evicted when its use passes the high watermark (down to the low one), or
when a put needs a contiguous range it does not have (until one fits). Victims are
replicas on that segment, least recently used object first (a get refreshes an object;
exists does not), skipping:
  - objects under a read lease (a reader may be copying their bytes right now);
  - pending objects (being written; they are not in the LRU until put_end).
An object that loses its last replica disappears from the pool; one that keeps another
replica stays visible with fewer copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.cache_master.objects import Segment

if TYPE_CHECKING:
    from services.cache_master.metadata import PoolMetadata


def evict_segment(meta: PoolMetadata, segment: Segment, now: float, need: int = 0) -> int:
    """Free replicas on `segment`; return how many were evicted.

    `need` > 0: stop as soon as a free range of `need` bytes exists. Otherwise stop when
    use is at or under the low watermark.
    """
    alloc = segment.allocator

    def done() -> bool:
        if need > 0:
            return alloc.largest_free >= alloc.aligned(need)
        return segment.use <= meta.limits.low_watermark

    evicted = 0
    if done():
        return 0
    for key in list(meta.lru):  # oldest first; the list copy allows removal while iterating
        obj = meta.objects.get(key)
        if obj is None or obj.leased(now) or obj.on(segment.store_id) is None:
            continue
        meta.drop_replica(obj, segment, free=True)
        evicted += 1
        if done():
            break
    return evicted
