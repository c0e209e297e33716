"""Re-replication policy: which objects get one more copy, where, and what a copy's
outcome changes. Pure Python on the metadata (no I/O, the clock passed in); repair.py
runs it over NATS.

    store lost (metadata._drop_segment) -> its objects left with 1..want-1 replicas are
    queued in `under_replicated` -> plan_repairs reserves a range on the least used store
    without a copy (evicting there if needed; none: the object waits in `unplaced` for
    the next mount) -> the target store copies and checks -> finish_repair adds the
    replica (an index update and a `stored` event) or frees the range.

Invariants (tests/pool/test_metadata.py): a copy is never listed before it is written;
a reserved range is freed whatever happens to the object or the target meanwhile; the
replicas of one object stay on distinct stores.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.cache_master.metadata.metadata import PoolMetadata
from services.cache_master.metadata.objects import PoolObject, Replica, Segment

MAX_TRIES = 3  # failed copies of one object before it waits for a store to mount


@dataclass
class Repair:
    """A copy of `obj` being made on `target` at `offset` (reserved there) from `source`."""

    obj: PoolObject
    source: Replica
    target: Segment
    offset: int


def plan_repairs(meta: PoolMetadata, now: float, limit: int) -> list[Repair]:
    """Reserve a range for one more copy of up to `limit` under-replicated objects, on
    the least used store without one (evicting there if needed). Objects with no such
    store wait in `unplaced` until a store mounts."""
    out: list[Repair] = []
    while meta.under_replicated and len(out) < limit:
        key = meta.under_replicated.pop()
        obj = meta.objects.get(key)
        if obj is None or not obj.complete or not obj.replicas:
            continue
        if len(obj.replicas) >= obj.want:
            continue
        holders = {r.store_id for r in obj.replicas}
        target = _repair_target(meta, obj.size, holders, now)
        offset = target.allocator.allocate(obj.size) if target is not None else None
        if target is None or offset is None:
            meta.unplaced.add(key)
            continue
        out.append(Repair(obj, obj.replicas[0], target, offset))
    return out


def _repair_target(meta: PoolMetadata, size: int, holders: set[str], now: float) -> Segment | None:
    for segment in sorted(meta.segments.values(), key=lambda s: (s.use, s.store_id)):
        if segment.store_id in holders:
            continue
        if segment.allocator.largest_free < segment.allocator.aligned(size):
            meta.evict(segment, now, need=size)
        if segment.allocator.largest_free >= segment.allocator.aligned(size):
            return segment
    return None


def finish_repair(meta: PoolMetadata, repair: Repair, copied: bool) -> bool:
    """The copy is written (`copied`) or failed: add the replica or free the range.
    False when the object or the target went away meanwhile (nothing added)."""
    target, obj = repair.target, repair.obj
    if meta.segments.get(target.store_id) is not target:
        return False  # the target was dropped, and its allocator with it
    alive = meta.objects.get(obj.key) is obj and obj.complete
    if not copied or not alive or obj.on(target.store_id) is not None:
        target.allocator.free(repair.offset)
        if alive and not copied:  # retried next sweep; after MAX_TRIES, at the next mount
            obj.repair_failures += 1
            retry = obj.repair_failures < MAX_TRIES
            (meta.under_replicated if retry else meta.unplaced).add(obj.key)
        return False
    obj.replicas.append(Replica(target.store_id, repair.offset))
    target.keys.add(obj.key)
    meta.changes.add(target.store_id, obj, repair.offset)
    meta.repaired += 1
    if len(obj.replicas) < obj.want:
        meta.under_replicated.add(obj.key)
    return True
