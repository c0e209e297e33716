"""What the stores' SSD tiers hold, and the choices made with it: what to spill, what a
get must promote, what counts as present. Pure Python, no I/O, like metadata/metadata.py (which it
reads and, for a promotion, reserves in); ssd.py sends the orders.

    an object's places:   DRAM only  --spill-->  DRAM + SSD  --evicted from DRAM-->  SSD only
                                                     ^                                  |
                                                     +------------promote (a get)-------+

`PoolMetadata` keeps the DRAM replicas as before (its LRU evicts them, unaware of SSD);
this index keeps the SSD copies, per store, as the stores reported them (a spill's reply,
a mount's report). A key is present in the pool when it is complete in the metadata or
has an SSD copy on a mounted store.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

from libs.common.messages.pool import PoolRecord
from services.cache_master.metadata.metadata import PoolMetadata
from services.cache_master.metadata.objects import (
    PoolObject,
    PoolRequestError,
    PutResult,
    Replica,
    Segment,
    check_checksum,
    check_key,
    check_mac,
)

SPILL_OBJECTS = 16  # objects per spill order (one order per store in flight); held from
SPILL_BYTES = 16 << 20  # eviction while it runs, so small orders back to back

SsdEvents = dict[str, dict[str, list[str]]]  # store -> "stored"/"removed" -> keys


@dataclass(frozen=True)
class SsdCopy:
    size: int
    checksum: str
    mac: str = ""


@dataclass
class Promotion:
    """Ranges reserved on one store for objects its SSD tier holds (pending objects of
    the metadata, under `put_id`, until the store has read them in)."""

    store_id: str
    put_id: str
    records: list[PoolRecord] = field(default_factory=list)


class SsdIndex:
    """key -> store -> copy, and the KV events (tier `ssd`) its changes make."""

    def __init__(self) -> None:
        self.capacity: dict[str, int] = {}  # store id -> its tier's --ssd-size (0: none)
        self.copies: dict[str, dict[str, SsdCopy]] = {}
        self.by_store: dict[str, set[str]] = {}
        self.events: SsdEvents = {}
        self.spilled = self.promoted = self.dropped = 0
        self.stranded = 0  # ranges held for promotions that got no answer (ssd_orders.py)
        self.degraded = 0  # tiers whose disk refused a write: DRAM only for a while

    def add(self, store_id: str, key: str, copy: SsdCopy) -> None:
        self.copies.setdefault(key, {})[store_id] = copy
        self.by_store.setdefault(store_id, set()).add(key)
        self._event(store_id, "stored", key)

    def discard(self, store_id: str, key: str) -> bool:
        held = self.copies.get(key)
        if held is None or held.pop(store_id, None) is None:
            return False
        if not held:
            del self.copies[key]
        self.by_store.get(store_id, set()).discard(key)
        self._event(store_id, "removed", key)
        return True

    def drop_store(self, store_id: str) -> None:
        """The store is gone (or reported again): forget its tier."""
        for key in list(self.by_store.get(store_id, ())):
            self.discard(store_id, key)
        self.by_store.pop(store_id, None)
        self.capacity.pop(store_id, None)

    def replace(self, store_id: str, capacity: int, records: Iterable[PoolRecord]) -> int:
        """A store's report of its whole tier; returns how many records were refused."""
        new: dict[str, SsdCopy] = {}
        refused = 0
        for r in records:
            try:
                check_key(r.key), check_checksum(r.checksum), check_mac(r.mac)
            except PoolRequestError:
                refused += 1
                continue
            if r.size <= 0:
                refused += 1
                continue
            new[r.key] = SsdCopy(r.size, r.checksum, r.mac)
        for key in list(self.by_store.get(store_id, ())):
            if self.copies.get(key, {}).get(store_id) != new.get(key):
                self.discard(store_id, key)
        for key, copy in new.items():
            if self.copies.get(key, {}).get(store_id) != copy:
                self.add(store_id, key, copy)
        if capacity > 0:
            self.capacity[store_id] = capacity
        else:
            self.capacity.pop(store_id, None)
        return refused

    def on(self, key: str, live: dict[str, Segment]) -> tuple[str, SsdCopy] | None:
        """An SSD copy of `key` on a mounted store, if any."""
        for store_id, copy in self.copies.get(key, {}).items():
            if store_id in live:
                return store_id, copy
        return None

    def take_events(self) -> SsdEvents:
        events, self.events = self.events, {}
        return events

    def _event(self, store_id: str, kind: str, key: str) -> None:
        self.events.setdefault(store_id, {}).setdefault(kind, []).append(key)

    def stats(self, meta: PoolMetadata) -> dict[str, int]:
        only = sum(1 for key in self.copies if key not in meta.objects)
        return {
            "tiers": len(self.capacity),
            "capacity": sum(self.capacity.values()),
            "copies": sum(len(held) for held in self.copies.values()),
            "bytes": sum(c.size for held in self.copies.values() for c in held.values()),
            "only": only,  # objects held on SSD only (not in any DRAM segment)
            "spilled": self.spilled,
            "promoted": self.promoted,
            "dropped": self.dropped,
            "stranded": self.stranded,
            "degraded": self.degraded,
        }


def present(meta: PoolMetadata, index: SsdIndex, key: str) -> bool:
    obj = meta.objects.get(key)
    if obj is not None and obj.complete:
        return True
    return index.on(key, meta.segments) is not None


def exists(meta: PoolMetadata, index: SsdIndex, keys: Iterable[str]) -> int:
    """How many leading keys are present, in DRAM or on SSD (metadata.exists's rule)."""
    count = 0
    for key in keys:
        if not present(meta, index, key):
            break
        count += 1
    return count


def on_ssd_only(meta: PoolMetadata, index: SsdIndex, key: str) -> bool:
    """Present on SSD, not in the metadata at all (not even pending): a put of it answers
    `exists`, a get promotes it."""
    return ssd_only_copy(meta, index, key) is not None


def ssd_only_copy(meta: PoolMetadata, index: SsdIndex, key: str) -> tuple[str, SsdCopy] | None:
    """The store and SSD copy of a key on SSD only (on_ssd_only), else None."""
    return None if key in meta.objects else index.on(key, meta.segments)


def plan_spills(
    meta: PoolMetadata,
    index: SsdIndex,
    segment: Segment,
    watermark: float,
    busy: set[str],
    now: float,
) -> list[PoolRecord]:
    """Cold objects of `segment` to copy to its store's SSD tier now.

    The oldest unleased objects in the LRU (those eviction could take now) whose bytes on
    this segment add up to what lies above `watermark` of its capacity are kept with an
    SSD copy, so the eviction that follows (at the high watermark, down to the low one)
    finds its victims already spilled and only forgets their DRAM ranges. Objects spilled
    already, or in an order now (`busy`), are skipped; at most SPILL_OBJECTS / SPILL_BYTES
    per order.
    """
    budget = segment.used - watermark * segment.capacity
    out: list[PoolRecord] = []
    size = 0
    if budget <= 0:
        return out
    for key in meta.lru:
        obj = meta.objects.get(key)
        replica = obj.on(segment.store_id) if obj is not None else None
        if obj is None or replica is None or obj.leased(now):
            continue
        budget -= obj.size
        if key not in busy and segment.store_id not in index.copies.get(key, {}):
            out.append(PoolRecord(key, replica.offset, obj.size, obj.checksum, obj.mac))
            size += obj.size
        if budget <= 0 or len(out) >= SPILL_OBJECTS or size >= SPILL_BYTES:
            break
    return out


def reserve_promotions(
    meta: PoolMetadata,
    index: SsdIndex,
    keys: Iterable[str],
    now: float,
    deadline: float = 0.0,
    skip: Iterable[str] = (),
) -> list[Promotion]:
    """For each key on SSD only: a range on the store that holds it (evicting there if
    needed, as a put does), as a pending object of the metadata until `deadline` (default:
    the put timeout); one Promotion per store. A key with no room, or held by a store in
    `skip`, is left out (a miss)."""
    deadline = deadline or now + meta.limits.put_timeout
    skipped = set(skip)
    by_store: dict[str, Promotion] = {}
    for key in dict.fromkeys(keys):
        held = ssd_only_copy(meta, index, key)
        if held is None or held[0] in skipped:
            continue
        store_id, copy = held
        segment = meta.segments[store_id]
        alloc = segment.allocator
        if alloc.largest_free < alloc.aligned(copy.size):
            meta.evict(segment, now, need=copy.size)
        offset = alloc.allocate(copy.size)
        if offset is None:
            continue
        promotion = by_store.get(store_id)
        if promotion is None:
            promotion = by_store[store_id] = Promotion(store_id, secrets.token_hex(8))
        meta.objects[key] = PoolObject(key, copy.size, copy.checksum,
                                       [Replica(store_id, offset)], put_id=promotion.put_id,
                                       put_deadline=deadline, mac=copy.mac)  # fmt: skip
        segment.keys.add(key)
        promotion.records.append(PoolRecord(key, offset, copy.size, copy.checksum, copy.mac))
    return list(by_store.values())


def held_on_ssd(meta: PoolMetadata, index: SsdIndex, keys: Iterable[str]) -> set[str]:
    """The keys of a put that are present on SSD only: answered `exists`, not reserved."""
    if not index.copies:
        return set()
    return {key for key in keys if on_ssd_only(meta, index, key)}


def with_held(keys: list[str], results: list[PutResult], held: set[str]) -> list[PutResult]:
    """put_start's results for the keys not `held`, with `exists` put back in order for
    those that were."""
    rest = iter(results)
    return [(key, "exists", []) if key in held else next(rest) for key in keys]
