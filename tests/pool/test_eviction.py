"""The LRU policy alone, on hand-built records: who is chosen, and where the walk stops."""

from services.cache_master.metadata.allocator import OffsetAllocator
from services.cache_master.metadata.eviction import Lru
from services.cache_master.metadata.objects import PoolObject, Replica, Segment

CK = "0123456789abcdef"
UNIT = 4096


def full_segment(keys, store_id="s0", lease_until=None):
    """A segment filled by one unit per key, each key complete and in the LRU in order."""
    segment = Segment(store_id, {"region_id": 1}, OffsetAllocator(len(keys) * UNIT), 0.0)
    lru, objects = Lru(), {}
    for key in keys:
        offset = segment.allocator.allocate(UNIT)
        obj = PoolObject(key, UNIT, CK, [Replica(store_id, offset)], complete=True)
        obj.lease_until = (lease_until or {}).get(key, 0.0)
        objects[key] = obj
        segment.keys.add(key)
        lru.add(key)
    return segment, lru, objects


def test_walk_takes_the_oldest_first_stops_at_the_watermark_and_keeps_the_order():
    segment, lru, objects = full_segment(["a", "b", "c", "d"])
    lru.touch("a")  # order: b, c, d, a
    victims = lru.evict(segment, objects, now=0.0, low_watermark=0.5)
    assert [o.key for o in victims] == ["b", "c"]
    assert segment.use == 0.5
    assert list(lru) == ["b", "c", "d", "a"]  # the caller forgets the victims, not the walk


def test_walk_skips_leased_objects_and_stops_once_the_needed_range_is_free():
    segment, lru, objects = full_segment(["a", "b", "c", "d"], lease_until={"a": 10.0})
    victims = lru.evict(segment, objects, now=5.0, low_watermark=0.0, need=UNIT)
    assert [o.key for o in victims] == ["b"]
    assert segment.allocator.largest_free == UNIT


def test_walk_frees_nothing_when_the_target_is_already_met():
    segment, lru, objects = full_segment(["a", "b"])
    assert lru.evict(segment, objects, now=0.0, low_watermark=1.0) == []
    assert segment.use == 1.0
