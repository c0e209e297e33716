"""The pool's metadata and its rules: mounts, two-phase puts, leases, LRU eviction.

Pure Python, no I/O and no clock of its own: every method that depends on time takes
`now` (monotonic seconds), so tests drive time by hand. The service calls these methods
from one event loop (no locking) and publishes `take_changes()` after each call.
What stores and readers report (a mount's records, bad replicas) is checked against it
in reports.py.

Invariants (tests/pool/test_metadata.py):
  - a key is visible (exists/get) only after put_end, and never while pending;
  - eviction and remove never free bytes of an object under a lease;
  - eviction never takes a replica a soft pin holds (`keep`, pins/book.py);
  - every replica's byte range is allocated in its segment's allocator exactly once;
  - the replicas of one object are on distinct stores.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from services.cache_master.metadata.allocator import OffsetAllocator
from services.cache_master.metadata.eviction import Lru
from services.cache_master.metadata.objects import (
    Changes,
    PoolObject,
    PoolRequestError,
    PutResult,
    PutSpec,
    Replica,
    ReportedRecord,
    Segment,
    check_checksum,
    check_key,
    check_mac,
)
from services.cache_master.metadata.reports import adopt


@dataclass(frozen=True)
class PoolLimits:
    """The master's policy knobs (its flags)."""

    replicas: int = 1
    max_object_size: int = 64 << 20
    lease_ttl: float = 10.0
    put_timeout: float = 30.0
    high_watermark: float = 0.9
    low_watermark: float = 0.8
    alignment: int = 64
    min_object_size: int = 64
    max_pending_puts: int = 8192  # pending objects per client
    max_lease_pin: float = 120.0  # longest unbroken lease of one object, seconds


class PoolMetadata:
    """Segments and objects of the pool, in memory; see the module docstring."""

    def __init__(self, limits: PoolLimits):
        self.limits = limits
        self.segments: dict[str, Segment] = {}
        self.objects: dict[str, PoolObject] = {}  # complete and pending, by key
        self.lru = Lru()  # complete keys, oldest first
        self.doomed: list[PoolObject] = []  # removed while leased: bytes held until expiry
        self.changes = Changes()
        self.hits = self.misses = self.evictions = self.repaired = 0
        self.pending_by_client: dict[str, int] = {}
        self.under_replicated: set[str] = set()  # keys to copy back up to `want` replicas
        self.unplaced: set[str] = set()  # under-replicated, no store to copy to: wait a mount
        # (object, segment) -> evict it first there (tiers/ssd_orders.py: it has an SSD copy)
        self.evict_first: Callable[[PoolObject, Segment], bool] | None = None
        self.keep: Callable[[PoolObject, Segment], bool] | None = None  # pinned (pins/book.py)

    def take_changes(self) -> Changes:
        changes, self.changes = self.changes, Changes()
        return changes

    # --- stores --------------------------------------------------------------------------

    def mount(
        self,
        store_id: str,
        descriptor: dict[str, Any],
        reported: Iterable[ReportedRecord],
        now: float,
    ) -> tuple[Segment, int]:
        """Mount or re-mount a store's segment; return it and how many reports were refused.

        Same region as mounted: the master's records stay and reports it lacks are added
        (a store that missed an update). A new region: the store restarted, so what the
        master had there is dropped and the store's reports are the truth.
        """
        length = descriptor.get("length")
        if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
            raise PoolRequestError(400, "segment.length: expected a positive integer")
        old = self.segments.get(store_id)
        if old is not None and old.region_id == descriptor.get("region_id"):
            segment = old
            segment.last_seen = now
        else:
            if old is not None:
                self._drop_segment(old)
            allocator = OffsetAllocator(length, self.limits.alignment)
            segment = Segment(store_id, descriptor, allocator, last_seen=now)
            self.segments[store_id] = segment
        rejected = 0
        for record in reported:
            if not adopt(self, segment, record):
                rejected += 1
        self.under_replicated |= self.unplaced  # a store more: maybe room for their copies
        self.unplaced.clear()
        return segment, rejected

    def heartbeat(self, store_id: str, region_id: int, now: float) -> Segment | None:
        segment = self.segments.get(store_id)
        if segment is None or segment.region_id != region_id:
            return None
        segment.last_seen = now
        return segment

    def unmount(self, store_id: str) -> bool:
        segment = self.segments.get(store_id)
        if segment is not None:
            self._drop_segment(segment)
        return segment is not None

    def expire_stores(self, now: float, timeout: float) -> list[str]:
        dead = [s for s in self.segments.values() if now - s.last_seen > timeout]
        for segment in dead:
            self._drop_segment(segment)
        return [s.store_id for s in dead]

    def _drop_segment(self, segment: Segment) -> None:
        """The store is gone: its bytes are unreachable, leased or not."""
        del self.segments[segment.store_id]
        for key in list(segment.keys):
            obj = self.objects.get(key)
            if obj is not None:
                self.drop_replica(obj, segment, free=False)
                if obj.complete and obj.replicas and len(obj.replicas) < obj.want:
                    self.under_replicated.add(key)
        self.doomed = [o for o in self.doomed if self._prune_doomed(o, segment.store_id)]

    def _prune_doomed(self, obj: PoolObject, store_id: str) -> bool:
        obj.replicas = [r for r in obj.replicas if r.store_id != store_id]
        return bool(obj.replicas)

    # --- writes --------------------------------------------------------------------------

    def put_start(
        self, specs: Sequence[PutSpec], replicas: int, now: float, client: str = ""
    ) -> tuple[str, list[PutResult]]:
        """Reserve ranges for each spec; return the put id and (key, status, replicas).

        Status `ok` (write every replica, then put_end), `exists` (the key is visible or
        being written: never overwritten), or `full` (no store has room, even after
        evicting unleased objects).
        """
        want = replicas or self.limits.replicas
        if want < 1:
            raise PoolRequestError(400, f"replicas: must be >= 1, got {replicas}")
        biggest = max((s.capacity for s in self.segments.values()), default=0)
        for spec in specs:  # refuse the whole batch before reserving anything
            check_key(spec.key)
            check_checksum(spec.checksum)
            check_mac(spec.mac)
            if spec.size < self.limits.min_object_size:
                raise PoolRequestError(400, f"size of {spec.key}: {spec.size} < the minimum "
                                       f"object size {self.limits.min_object_size}")  # fmt: skip
            if spec.size > self.limits.max_object_size or (self.segments and spec.size > biggest):
                limit = min(self.limits.max_object_size, biggest or self.limits.max_object_size)
                raise PoolRequestError(413, f"size of {spec.key}: {spec.size} > limit {limit}")
        pending = self.pending_by_client.get(client, 0)
        if pending + len(specs) > self.limits.max_pending_puts:
            raise PoolRequestError(429, f"client {client[:80]!r}: {pending} objects pending + "
                                   f"{len(specs)} asked > the limit {self.limits.max_pending_puts}"
                                   "; finish (put_end) or revoke puts first")  # fmt: skip
        put_id = secrets.token_hex(8)
        out: list[PutResult] = []
        for spec in specs:
            if spec.key in self.objects:
                out.append((spec.key, "exists", []))
                continue
            obj = PoolObject(spec.key, spec.size, spec.checksum, [], put_id=put_id,
                             put_deadline=now + self.limits.put_timeout, want=want,
                             client=client, mac=spec.mac)  # fmt: skip
            for segment in self._placement(spec.size, want, now):
                offset = segment.allocator.allocate(spec.size)
                if offset is not None:  # _placement made room
                    obj.replicas.append(Replica(segment.store_id, offset))
                    segment.keys.add(spec.key)
            if not obj.replicas:
                out.append((spec.key, "full", []))
                continue
            self.objects[spec.key] = obj
            obj.counted = True
            self.pending_by_client[client] = self.pending_by_client.get(client, 0) + 1
            out.append((spec.key, "ok", list(obj.replicas)))
        self.enforce_watermarks(now)
        return put_id, out

    def _placement(self, size: int, want: int, now: float) -> list[Segment]:
        """Up to `want` distinct stores with room for `size`, least used first."""
        chosen: list[Segment] = []
        for segment in sorted(self.segments.values(), key=lambda s: (s.use, s.store_id)):
            if len(chosen) == want:
                break
            if segment.allocator.largest_free < segment.allocator.aligned(size):
                self.evict(segment, now, need=size)
            if segment.allocator.largest_free >= segment.allocator.aligned(size):
                chosen.append(segment)
        return chosen

    def put_end(self, put_id: str, keys: Iterable[str]) -> list[str]:
        """Make the put's `keys` visible; return those that were (others: expired/unknown)."""
        done: list[str] = []
        for key in keys:
            obj = self.objects.get(key)
            if obj is None or obj.complete or obj.put_id != put_id or not obj.replicas:
                continue
            obj.complete = True
            self._unpend(obj)
            self.lru.add(key)
            for replica in obj.replicas:
                self.changes.add(replica.store_id, obj, replica.offset)
            done.append(key)
        return done

    def put_revoke(self, put_id: str, keys: Iterable[str]) -> int:
        done = 0
        for key in keys:
            obj = self.objects.get(key)
            if obj is not None and not obj.complete and obj.put_id == put_id:
                self._delete(obj)
                done += 1
        return done

    def expire_puts(self, now: float) -> int:
        stale = [o for o in self.objects.values() if not o.complete and o.put_deadline < now]
        for obj in stale:
            self._delete(obj)
        return len(stale)

    # --- reads ---------------------------------------------------------------------------

    def get(self, keys: Iterable[str], now: float) -> list[tuple[str, PoolObject | None, str]]:
        """(key, object, error): visible objects, each leased until now + lease_ttl; None
        for a miss. Error `pinned` (and None): leasing it again would make its unbroken
        lease longer than max_lease_pin, so it is refused until its lease ends."""
        out: list[tuple[str, PoolObject | None, str]] = []
        for key in keys:
            obj = self.objects.get(key)
            if obj is None or not obj.complete or not obj.replicas:
                self.misses += 1
                out.append((key, None, ""))
                continue
            if not obj.leased(now):
                obj.lease_since = now
            elif now + self.limits.lease_ttl > obj.lease_since + self.limits.max_lease_pin:
                self.misses += 1
                out.append((key, None, "pinned"))
                continue
            self.hits += 1
            obj.lease_until = max(obj.lease_until, now + self.limits.lease_ttl)
            self.lru.touch(key)
            out.append((key, obj, ""))
        return out

    def exists(self, keys: Iterable[str]) -> int:
        """How many leading keys are visible (a prompt's cached prefix in pages)."""
        count = 0
        for key in keys:
            obj = self.objects.get(key)
            if obj is None or not obj.complete:
                break
            count += 1
        return count

    # --- removal and eviction ------------------------------------------------------------

    def remove(self, keys: Iterable[str], now: float) -> int:
        done = 0
        for key in keys:
            obj = self.objects.get(key)
            if obj is None or not obj.complete:
                continue
            if obj.leased(now):  # invisible now; bytes stay until the reader is done
                self._unlist(obj)
                for replica in obj.replicas:
                    self.segments[replica.store_id].keys.discard(key)
                    self.changes.remove(replica.store_id, key)
                self.doomed.append(obj)
            else:
                self._delete(obj)
            done += 1
        return done

    def reap(self, now: float) -> int:
        """Free the bytes of removed objects whose lease has ended."""
        ended = [o for o in self.doomed if not o.leased(now)]
        self.doomed = [o for o in self.doomed if o.leased(now)]
        for obj in ended:
            for replica in obj.replicas:
                segment = self.segments.get(replica.store_id)
                if segment is not None:
                    segment.allocator.free(replica.offset)
        return len(ended)

    def enforce_watermarks(self, now: float) -> int:
        evicted = 0
        for segment in self.segments.values():
            if segment.use > self.limits.high_watermark:
                evicted += self.evict(segment, now)
        return evicted

    def evict(self, segment: Segment, now: float, need: int = 0) -> int:
        """Evict LRU replicas on `segment` (policy: eviction.py); return how many."""
        first, keep = self.evict_first, self.keep
        accept = (lambda obj: first(obj, segment)) if first is not None else None
        held = (lambda obj: keep(obj, segment)) if keep is not None else None
        victims = self.lru.evict(segment, self.objects, now, self.limits.low_watermark, need,
                                 first=accept, keep=held)  # fmt: skip
        for obj in victims:
            self.drop_replica(obj, segment, free=False)  # the walk freed its bytes
        self.evictions += len(victims)
        return len(victims)

    def _delete(self, obj: PoolObject) -> None:
        for replica in list(obj.replicas):
            segment = self.segments.get(replica.store_id)
            if segment is not None:
                self.drop_replica(obj, segment, free=True)

    def drop_replica(self, obj: PoolObject, segment: Segment, free: bool) -> None:
        """Forget `obj`'s replica on `segment` (freeing its range when `free`)."""
        replica = obj.on(segment.store_id)
        if replica is None:
            return
        obj.replicas.remove(replica)
        segment.keys.discard(obj.key)
        if free:
            segment.allocator.free(replica.offset)
        if obj.complete:
            self.changes.remove(segment.store_id, obj.key)
        if not obj.replicas:
            self._unlist(obj)

    def _unlist(self, obj: PoolObject) -> None:
        if self.objects.get(obj.key) is obj:
            del self.objects[obj.key]
        self.lru.discard(obj.key)
        self._unpend(obj)

    def _unpend(self, obj: PoolObject) -> None:
        """`obj` is no longer pending: its client may reserve one more."""
        if not obj.counted:
            return
        obj.counted = False
        left = self.pending_by_client.get(obj.client, 0) - 1
        if left > 0:
            self.pending_by_client[obj.client] = left
        else:
            self.pending_by_client.pop(obj.client, None)

    # --- stats ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        visible = [o for o in self.objects.values() if o.complete]
        return {
            "objects": len(visible),
            "pending": len(self.objects) - len(visible),
            "bytes": sum(o.size for o in visible),
            "capacity": sum(s.capacity for s in self.segments.values()),
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "under_replicated": len(self.under_replicated) + len(self.unplaced),
            "repaired": self.repaired,
            "stores": {
                s.store_id: {"capacity": s.capacity, "used": s.used, "objects": len(s.keys)}
                for s in self.segments.values()
            },
        }
