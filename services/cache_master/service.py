"""The cache master service: the pool's metadata behind NATS micro endpoints.

Every endpoint is `tandem.pool.master.<name>` in queue group `tandem-pool-master`. The
master holds no bytes: it answers where to write and where to read; stores and clients
move the bytes with the transfer engine. After every change it publishes, per store,
a `PoolStoreUpdate` (the store's own index, so a restarted master can be told what each
store holds) and `KvEvent`s with tier `pool` (so the router knows what the pool holds).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from libs.common.bus.connection import Endpoint, HandlerError
from libs.common.bus.kv_events import events_subject, keep_kv_stream
from libs.common.log import get_logger
from libs.common.messages.control import InfoRequest, KvEvent, Message
from libs.common.messages.pool import (
    PoolCount,
    PoolFound,
    PoolGetReply,
    PoolHeartbeatReply,
    PoolKeys,
    PoolMasterEpoch,
    PoolMount,
    PoolMountChunk,
    PoolMountEnd,
    PoolMountPage,
    PoolMountReply,
    PoolPutFinish,
    PoolPutStart,
    PoolPutStartReply,
    PoolRecord,
    PoolReplica,
    PoolSlot,
    PoolStats,
    PoolStoreRef,
    PoolStoreUpdate,
    chunk_records,
)
from libs.common.service import BaseService
from libs.common.transfer import RegionDescriptor
from services.cache_master.config import CacheMasterConfig
from services.cache_master.epoch import outranks, pick_epoch, plausible
from services.cache_master.metadata import PoolLimits, PoolMetadata
from services.cache_master.mounts import Mounts
from services.cache_master.objects import Changes, PoolRequestError, PutSpec, Replica
from services.cache_master.repair import Repairer

log = get_logger(__name__)

QUEUE_GROUP = "tandem-pool-master"
EVENT_KEYS = 4096  # keys per KvEvent / removed keys per index update (payload bound)


class CacheMasterService(BaseService):
    """Keeps the pool's metadata in memory; stores and clients talk to it over NATS."""

    description = "Tandem cache master: KV pool metadata"

    def __init__(self, config: CacheMasterConfig):
        super().__init__(config)
        self.config: CacheMasterConfig = config
        self.meta = PoolMetadata(
            PoolLimits(
                replicas=config.replicas,
                max_object_size=config.max_object_size,
                lease_ttl=config.lease_ttl,
                put_timeout=config.put_timeout,
                high_watermark=config.high_watermark,
                low_watermark=config.low_watermark,
                min_object_size=config.min_object_size,
                max_pending_puts=config.max_pending_puts,
                max_lease_pin=config.max_lease_pin,
            )
        )
        self.mounts = Mounts(idle_timeout=config.mount_timeout)
        self.epoch = config.epoch  # 0: picked at start (epoch.py); an election may set it
        self.fenced_by = 0  # the higher epoch that made this master stop serving
        self._event_seq: dict[str, int] = {}
        self._sweeper: asyncio.Task | None = None
        self._epoch_sub: Any = None
        self._fence_task: asyncio.Task | None = None
        self.repairer = Repairer(self.bus, self.meta, config.subject_prefix, self._publish_changes)

    def details(self) -> dict[str, Any]:
        return {
            "heartbeat_timeout": self.config.heartbeat_timeout,
            "lease_ttl": self.config.lease_ttl,
            "replicas": self.config.replicas,
            "epoch": self.epoch,
            "fenced_by": self.fenced_by,
            "stores": len(self.meta.segments),
            "objects": len(self.meta.lru),
        }

    def endpoints(self) -> list[Endpoint]:
        handlers = {
            "mount": (PoolMount, self._mount),
            "mount_chunk": (PoolMountChunk, self._mount_chunk),
            "mount_end": (PoolMountEnd, self._mount_end),
            "mount_page": (PoolMountPage, self._mount_page),
            "unmount": (PoolStoreRef, self._unmount),
            "heartbeat": (PoolStoreRef, self._heartbeat),
            "put_start": (PoolPutStart, self._put_start),
            "put_end": (PoolPutFinish, self._put_end),
            "put_revoke": (PoolPutFinish, self._put_revoke),
            "get": (PoolKeys, self._get),
            "exists": (PoolKeys, self._exists),
            "remove": (PoolKeys, self._remove),
            "stats": (InfoRequest, self._stats),
        }
        # Not concurrent: each endpoint serves its requests one at a time, in order; every
        # handler changes the index before its first await (the publishes of its changes).
        prefix = self.subject("pool", "master")
        return [
            Endpoint(name, f"{prefix}.{name}", kind, self._unfenced(handler), QUEUE_GROUP)
            for name, (kind, handler) in handlers.items()
        ]

    async def on_start(self) -> None:
        self.epoch = pick_epoch(self.epoch)
        self.repairer.epoch = self.epoch
        try:
            await keep_kv_stream(self.bus, self.config.subject_prefix)
        except Exception as e:  # events still flow on core NATS without the stream
            log.warning("kv events stream unavailable", error=str(e) or type(e).__name__)
        # Before the endpoints: a running master with a higher epoch fences this one
        # before any store could mount here.
        self._epoch_sub = await self.bus.subscribe(self._epoch_subject, self._on_epoch)
        await self._announce()
        log.info("master epoch", epoch=self.epoch)
        self._sweeper = asyncio.create_task(self._sweep_loop())

    async def on_stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        await self.repairer.stop()
        sub, self._epoch_sub = self._epoch_sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as e:  # closed connection: nothing to unsubscribe from
                log.debug("unsubscribe failed", error=str(e))

    # --- the epoch (epoch.py) ------------------------------------------------------------

    @property
    def _epoch_subject(self) -> str:
        return self.subject("pool", "master", "epoch")

    async def _announce(self) -> None:
        try:
            await self.bus.publish(self._epoch_subject,
                                   PoolMasterEpoch(self.epoch, self.config.service_id))  # fmt: skip
        except Exception as e:  # the next sweep announces again
            log.warning("epoch announcement failed", error=str(e))

    async def _on_epoch(self, msg: Any) -> None:
        try:
            other = PoolMasterEpoch.decode(msg.data)
        except ValueError as e:
            log.warning("bad epoch announcement ignored", error=str(e))
            return
        if (other.epoch, other.master_id) == (self.epoch, self.config.service_id):
            return  # our own
        if not plausible(other.epoch):
            log.warning("implausible epoch announcement ignored", epoch=other.epoch,
                        master=other.master_id[:80])  # fmt: skip
            return
        if outranks(self.epoch, self.config.service_id, other.epoch, other.master_id):
            self._fence(other.epoch, f"master {other.master_id!r}")
        elif not self.fenced_by:
            await self._announce()  # so the stale one learns

    def _seen(self, epoch: int, store_id: str) -> None:
        """A store has seen `epoch`: above ours, this master is stale."""
        if not plausible(epoch):
            raise HandlerError(400, f"epoch {epoch}: above what the clock allows; refused")
        if epoch > self.epoch:
            self._fence(epoch, f"store {store_id!r}")
        if self.fenced_by:
            raise HandlerError(409, f"master epoch {self.epoch} is stale: epoch "
                               f"{self.fenced_by} serves the pool")  # fmt: skip

    def _fence(self, epoch: int, by: str) -> None:
        if self.fenced_by:
            return
        self.fenced_by = epoch
        log.error("a master with a higher epoch exists; this one stops serving (restart it "
                  "to take over)", epoch=self.epoch, higher=epoch, seen_from=by)  # fmt: skip
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._fence_task = asyncio.create_task(self.bus.stop_services())

    def _unfenced(self, handler: Any) -> Any:
        async def guarded(req: Any) -> Any:
            if self.fenced_by:
                raise HandlerError(409, f"master epoch {self.epoch} is stale: epoch "
                                   f"{self.fenced_by} serves the pool")  # fmt: skip
            return await handler(req)

        return guarded

    # --- stores --------------------------------------------------------------------------

    async def _mount(self, req: PoolMount) -> PoolMountReply:
        """Begin a mount (mounts.py): nothing changes until its end."""
        self._seen(req.epoch, req.store_id)
        if not req.store_id:
            raise HandlerError(400, "store_id: required")
        try:
            RegionDescriptor.from_dict(req.segment)
        except ValueError as e:
            raise HandlerError(400, f"segment: {e}") from None
        session = self._call(self.mounts.begin, req.store_id, req.segment, req.records,
                             time.monotonic())  # fmt: skip
        return PoolMountReply(epoch=self.epoch, mount_id=session.mount_id)

    async def _mount_chunk(self, req: PoolMountChunk) -> PoolCount:
        self._seen(req.epoch, req.store_id)
        session = self._call(self.mounts.chunk, req.store_id, req.mount_id, req.index,
                             req.records, time.monotonic())  # fmt: skip
        return PoolCount(len(session.records))

    async def _mount_end(self, req: PoolMountEnd) -> PoolMountReply:
        """All chunks in: mount with every record at once, answer page 0 of the list."""
        self._seen(req.epoch, req.store_id)
        now = time.monotonic()
        session = self._call(self.mounts.end, req.store_id, req.mount_id, req.chunks,
                             req.records, now)  # fmt: skip
        segment, rejected = self._call(self.meta.mount, req.store_id, session.descriptor,
                                       session.records, now)  # fmt: skip
        records = []
        for key in sorted(segment.keys):
            obj = self.meta.objects.get(key)
            replica = obj.on(req.store_id) if obj is not None else None
            if obj is not None and obj.complete and replica is not None:
                records.append(PoolRecord(key, replica.offset, obj.size, obj.checksum))
        session.rejected = rejected
        self.mounts.finish(session, records, segment.update_seq)
        log.info("store mounted", store=req.store_id, objects=len(records), rejected=rejected,
                 capacity=segment.capacity, chunks=req.chunks)  # fmt: skip
        # The store takes the records from the pages; events only, no index update.
        await self._publish(self.meta.take_changes(), update_stores=False)
        return self._page(session, 0)

    async def _mount_page(self, req: PoolMountPage) -> PoolMountReply:
        self._seen(req.epoch, req.store_id)
        session = self._call(self.mounts.page, req.store_id, req.mount_id, req.page,
                             time.monotonic())  # fmt: skip
        return self._page(session, req.page)

    def _page(self, session: Any, page: int) -> PoolMountReply:
        return PoolMountReply(session.pages[page], session.rejected, session.update_seq,
                              epoch=self.epoch, mount_id=session.mount_id, page=page,
                              pages=len(session.pages))  # fmt: skip

    async def _unmount(self, req: PoolStoreRef) -> PoolCount:
        self._seen(req.epoch, req.store_id)
        if not self.meta.unmount(req.store_id):
            raise HandlerError(404, f"unknown store segment {req.store_id!r}")
        log.info("store unmounted", store=req.store_id)
        await self._publish(self.meta.take_changes())
        return PoolCount(1)

    async def _heartbeat(self, req: PoolStoreRef) -> PoolHeartbeatReply:
        self._seen(req.epoch, req.store_id)
        segment = self.meta.heartbeat(req.store_id, req.region_id, time.monotonic())
        if segment is None:
            return PoolHeartbeatReply(known=False, epoch=self.epoch)
        return PoolHeartbeatReply(known=True, update_seq=segment.update_seq, epoch=self.epoch)

    # --- objects -------------------------------------------------------------------------

    async def _put_start(self, req: PoolPutStart) -> PoolPutStartReply:
        specs = [PutSpec(o.key, o.size, o.checksum) for o in req.objects]
        put_id, results = self._call(self.meta.put_start, specs, req.replicas, time.monotonic(),
                                     req.client)  # fmt: skip
        await self._publish(self.meta.take_changes())  # evictions made room
        slots = [PoolSlot(status, _replicas(replicas)) for _, status, replicas in results]
        segments = self._segments([replicas for _, _, replicas in results])
        return PoolPutStartReply(put_id, slots, segments, self.config.put_timeout, epoch=self.epoch)

    async def _put_end(self, req: PoolPutFinish) -> PoolKeys:
        visible = self.meta.put_end(req.put_id, req.keys)
        await self._publish(self.meta.take_changes())
        return PoolKeys(visible)

    async def _put_revoke(self, req: PoolPutFinish) -> PoolCount:
        count = self.meta.put_revoke(req.put_id, req.keys)
        await self._publish(self.meta.take_changes())
        return PoolCount(count)

    async def _get(self, req: PoolKeys) -> PoolGetReply:
        looked = self.meta.get(req.keys, time.monotonic())
        found = [obj for _, obj, _ in looked]
        objects = [
            PoolFound(obj.size, obj.checksum, _replicas(obj.replicas))
            if obj
            else PoolFound(error=error)
            for _, obj, error in looked
        ]
        segments = self._segments([obj.replicas for obj in found if obj])
        return PoolGetReply(objects, segments, self.config.lease_ttl)

    async def _exists(self, req: PoolKeys) -> PoolCount:
        return PoolCount(self.meta.exists(req.keys))

    async def _remove(self, req: PoolKeys) -> PoolCount:
        count = self.meta.remove(req.keys, time.monotonic())
        await self._publish(self.meta.take_changes())
        return PoolCount(count)

    async def _stats(self, _req: InfoRequest) -> PoolStats:
        return PoolStats(**self.meta.stats(), epoch=self.epoch)

    # --- helpers -------------------------------------------------------------------------

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except PoolRequestError as e:
            raise HandlerError(e.code, e.message) from None

    def _segments(self, replicas: list[list[Replica]]) -> dict[str, dict[str, Any]]:
        """The descriptor of each store named: once per reply, however many replicas."""
        named = {r.store_id for rs in replicas for r in rs}
        return {sid: self.meta.segments[sid].descriptor for sid in named}

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval)
            try:
                await self.sweep()
            except Exception:  # a sweep bug must not stop the next sweeps
                log.exception("sweep failed")

    async def sweep(self) -> None:
        now = time.monotonic()
        for store_id in self.meta.expire_stores(now, self.config.heartbeat_timeout):
            log.warning("store silent; its replicas are dropped", store=store_id,
                        timeout=self.config.heartbeat_timeout)  # fmt: skip
        stale = self.meta.expire_puts(now)
        if stale:
            log.info("unfinished puts reclaimed", count=stale)
        self.mounts.expire(now)
        self.meta.reap(now)
        self.meta.enforce_watermarks(now)
        await self._publish(self.meta.take_changes())
        self.repairer.kick()
        await self._announce()

    async def _publish_changes(self) -> None:
        await self._publish(self.meta.take_changes())

    async def _publish(self, changes: Changes, update_stores: bool = True) -> None:
        """Index updates to each live store, then KV events. Built first, then sent, so
        the per-store sequence numbers go out in order."""
        out: list[tuple[str, Message]] = []
        for store_id in changes.stores:
            added = changes.added.get(store_id, [])
            removed = changes.removed.get(store_id, [])
            segment = self.meta.segments.get(store_id)
            if update_stores and segment is not None:
                subject = self.subject("pool", "store", store_id, "update")
                for records, gone in _update_chunks([PoolRecord(*a) for a in added], removed):
                    segment.update_seq += 1
                    update = PoolStoreUpdate(segment.update_seq, records, gone, epoch=self.epoch)
                    out.append((subject, update))
            subject = events_subject(self.config.subject_prefix, store_id)
            for kind, keys in (("removed", removed), ("stored", [a[0] for a in added])):
                for start in range(0, len(keys), EVENT_KEYS):
                    event = self._event(store_id, kind, keys[start : start + EVENT_KEYS])
                    out.append((subject, event))
        for subject, message in out:
            try:
                await self.bus.publish(subject, message)
            except Exception as e:  # a lost update is repaired by the store's re-mount
                log.warning("pool publish failed", subject=subject, error=str(e))

    def _event(self, store_id: str, kind: str, keys: list[str]) -> KvEvent:
        # Seeded from the clock so a restarted master continues above its predecessor's.
        seq = self._event_seq.get(store_id, time.time_ns() // 1000) + 1
        self._event_seq[store_id] = seq
        return KvEvent(store_id, seq, kind, "pool", keys, timestamp=time.time())


def _update_chunks(records: list[PoolRecord], removed: list[str]) -> list[tuple[list, list]]:
    """Index changes cut into updates within NATS's payload limit (one, usually)."""
    out: list[tuple[list, list]] = [([], removed[i : i + EVENT_KEYS])
                                    for i in range(0, len(removed), EVENT_KEYS)]  # fmt: skip
    if records:
        out += [(chunk, []) for chunk in chunk_records(records)]
    return out


def _replicas(replicas: list[Replica]) -> list[PoolReplica]:
    return [PoolReplica(r.store_id, r.offset) for r in replicas]
