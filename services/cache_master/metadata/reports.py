"""Reports from outside the master, taken only where they match what it knows: a store's
records at its mount (`adopt`) and a reader's bad replicas (`drop_bad`). Pure Python on
the metadata, no I/O, the clock passed in.

Invariants (tests/pool/test_metadata.py, tests/pool/test_kv_mac.py): a report never
replaces other bytes under the same key, never takes a range twice, and a late or
mistaken bad-replica report drops nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from services.cache_master.metadata.allocator import AllocationError
from services.cache_master.metadata.eviction import Lru
from services.cache_master.metadata.objects import (
    BadReport,
    Changes,
    PoolObject,
    PoolRequestError,
    Replica,
    ReportedRecord,
    Segment,
    check_checksum,
    check_key,
    check_mac,
)


class ObjectLimits(Protocol):
    """The bounds a reported object is held to (PoolLimits' fields)."""

    @property
    def replicas(self) -> int: ...
    @property
    def min_object_size(self) -> int: ...
    @property
    def max_object_size(self) -> int: ...


class ReportedOn(Protocol):
    """What a report reads and changes of the metadata (PoolMetadata, which calls `adopt`
    from its mount: this module knows the parts, not the class, so the two do not import
    each other)."""

    objects: dict[str, PoolObject]
    segments: dict[str, Segment]
    lru: Lru
    changes: Changes
    doomed: list[PoolObject]
    under_replicated: set[str]

    @property
    def limits(self) -> ObjectLimits: ...

    def drop_replica(self, obj: PoolObject, segment: Segment, free: bool) -> None: ...


def adopt(meta: ReportedOn, segment: Segment, record: ReportedRecord) -> bool:
    """Take a store's report of one object it holds, if it fits what is known."""
    try:
        key, checksum = check_key(record.key), check_checksum(record.checksum)
        mac = check_mac(record.mac)
    except PoolRequestError:
        return False
    obj = meta.objects.get(key)
    known = obj.on(segment.store_id) if obj is not None else None
    if known is not None:
        return known.offset == record.offset  # already known here
    if obj is not None and (not obj.complete or (obj.size, obj.checksum, obj.mac) != (
        record.size, checksum, mac)):  # fmt: skip
        return False  # a put in progress, or other bytes under the same key
    if not meta.limits.min_object_size <= record.size <= meta.limits.max_object_size:
        return False
    try:
        segment.allocator.allocate_at(record.offset, record.size)
    except AllocationError:
        return False
    if obj is None:
        obj = PoolObject(key, record.size, checksum, [], complete=True,
                         want=meta.limits.replicas, mac=mac)  # fmt: skip
        meta.objects[key] = obj
        meta.lru.add(key)
    obj.replicas.append(Replica(segment.store_id, record.offset))
    segment.keys.add(key)
    meta.changes.add(segment.store_id, obj, record.offset)
    return True


def drop_bad(meta: ReportedOn, reports: Iterable[BadReport], now: float) -> int:
    """Forget replicas a reader found bad (bytes failing their checksum or MAC tag).

    Only a report that matches the record drops anything: same checksum and tag, the
    replica on the same store at the same offset. A late report (the object was
    removed and put again, or placed elsewhere) or one about another object's bytes
    does nothing. A leased replica's range is freed when the lease ends; an object
    left with no replica is gone, one left with fewer than asked is re-replicated
    from a good one.
    """
    done = 0
    for report in reports:
        obj = meta.objects.get(report.key)
        if obj is None or not obj.complete or (obj.checksum, obj.mac) != (
            report.checksum, report.mac):  # fmt: skip
            continue
        replica, segment = obj.on(report.store), meta.segments.get(report.store)
        if replica is None or segment is None or replica.offset != report.offset:
            continue
        if obj.leased(now):  # held (invisible) until the lease ends: reap frees it
            held = PoolObject(obj.key, obj.size, obj.checksum, [replica], complete=True,
                              lease_until=obj.lease_until)  # fmt: skip
            meta.doomed.append(held)
        meta.drop_replica(obj, segment, free=not obj.leased(now))
        if obj.replicas and len(obj.replicas) < obj.want:
            meta.under_replicated.add(obj.key)
        done += 1
    return done
