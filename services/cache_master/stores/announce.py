"""What the master says about changes to the pool: index updates to each store and KV
events for the routers (docs/pool.md, docs/protocol.md).

Built first, then sent, so each store's update sequence numbers go out in order. A lost
update is repaired by the store's re-mount; events are hints (the index is the truth).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from libs.common.bus.connection import Bus
from libs.common.bus.kv_events import events_subject
from libs.common.log import get_logger
from libs.common.messages.control import KvEvent, Message
from libs.common.messages.pool import PoolRecord, PoolStoreUpdate, chunk_records
from services.cache_master.metadata.metadata import PoolMetadata
from services.cache_master.metadata.objects import Changes

log = get_logger(__name__)

EVENT_KEYS = 4096  # keys per KvEvent / removed keys per index update (payload bound)


class Announcer:
    """Publishes `Changes` of `meta`: `publish` (stores' updates, tier `pool` events) and
    `publish_ssd` (tier `ssd` events). `epoch()` is the master's epoch now."""

    def __init__(self, bus: Bus, prefix: str, meta: PoolMetadata, epoch: Callable[[], int]):
        self.bus, self.prefix, self.meta, self.epoch = bus, prefix, meta, epoch
        self._event_seq: dict[str, int] = {}

    async def publish(self, changes: Changes, update_stores: bool = True) -> None:
        out: list[tuple[str, Message]] = []
        for store_id in changes.stores:
            added = changes.added.get(store_id, [])
            removed = changes.removed.get(store_id, [])
            segment = self.meta.segments.get(store_id)
            if update_stores and segment is not None:
                subject = f"{self.prefix}.pool.store.{store_id}.update"
                for records, gone in update_chunks([PoolRecord(*a) for a in added], removed):
                    segment.update_seq += 1
                    update = PoolStoreUpdate(segment.update_seq, records, gone,
                                             epoch=self.epoch())  # fmt: skip
                    out.append((subject, update))
            subject = events_subject(self.prefix, store_id)
            for kind, keys in (("removed", removed), ("stored", [a[0] for a in added])):
                for start in range(0, len(keys), EVENT_KEYS):
                    event = self._event(store_id, kind, keys[start : start + EVENT_KEYS])
                    out.append((subject, event))
        for subject, message in out:
            await self._send(subject, message)

    async def publish_ssd(self, events: dict[str, dict[str, list[str]]]) -> None:
        """KV events of the stores' SSD tiers (tiers/ssd_orders.py): tier `ssd`, the store's seq."""
        for store_id, kinds in events.items():
            subject = events_subject(self.prefix, store_id)
            for kind in ("removed", "stored"):
                keys = kinds.get(kind, [])
                for start in range(0, len(keys), EVENT_KEYS):
                    event = self._event(store_id, kind, keys[start : start + EVENT_KEYS], "ssd")
                    await self._send(subject, event)

    def _event(self, store_id: str, kind: str, keys: list[str], tier: str = "pool") -> KvEvent:
        # Seeded from the clock so a restarted master continues above its predecessor's.
        seq = self._event_seq.get(store_id, time.time_ns() // 1000) + 1
        self._event_seq[store_id] = seq
        return KvEvent(store_id, seq, kind, tier, keys, timestamp=time.time())

    async def _send(self, subject: str, message: Message) -> None:
        try:
            await self.bus.publish(subject, message)
        except Exception as e:  # see the module docstring: repaired or a hint
            log.warning("pool publish failed", subject=subject, error=str(e))


def update_chunks(
    records: list[PoolRecord], removed: list[str]
) -> list[tuple[list[PoolRecord], list[str]]]:
    """Index changes cut into updates within NATS's payload limit (one, usually)."""
    out: list[tuple[list[PoolRecord], list[str]]] = [([], removed[i : i + EVENT_KEYS])
                                    for i in range(0, len(removed), EVENT_KEYS)]  # fmt: skip
    if records:
        out += [(chunk, []) for chunk in chunk_records(records)]
    return out
