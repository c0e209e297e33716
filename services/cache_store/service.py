"""The cache store service: one registered segment, mounted on the master, kept in sync.

    start:  transfer engine up -> segment (anonymous or --segment-file) registered ->
            saved index verified (segment file) -> subscribe to my index updates ->
            control loop: mount (retrying until a master answers), then heartbeats
    loop:   heartbeat every --heartbeat-interval; `known: false` (the master restarted
            or timed us out) or a gap in update numbers -> mount again, reporting what
            this store holds in chunks; the master answers with the authoritative list,
            in pages (services/cache_master/stores/mounts.py)
    stop:   unmount (clients stop being sent here), save the index, stop the engine

Epochs (services/cache_master/ha/epoch.py): the store keeps the highest master epoch it has
seen, sends it with every request, and takes mount replies, index updates and copy
orders only from that epoch; a reply from a higher one makes it mount there.
`replicate` (PoolReplicate): the master asks this store to copy objects from another
store's segment into its own (after a store was lost); each checksum is checked.

`ssd` (PoolSsdOrder, with --ssd-dir): the master orders spills of cold objects to the SSD
tier, promotions back into the segment and removals (ssd.py, ssd_orders.py); after every
mount the store reports the tier (PoolSsdReport on `ssd_report`).

Peers never ask this service for bytes over NATS: they read and write the segment
directly through the transfer engine, with the descriptor the master hands out: a grant
of this store's (`grant`, grants.py) for one put's or one get's ranges only.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, TypeVar

from nats.aio.msg import Msg

from libs.common.bus.connection import BusError, Endpoint, HandlerError
from libs.common.log import get_logger
from libs.common.messages.control import Message, MessageError
from libs.common.messages.mounts import (
    PoolMount,
    PoolMountChunk,
    PoolMountEnd,
    PoolMountPage,
    PoolMountReply,
)
from libs.common.messages.pool import (
    PoolCopy,
    PoolCount,
    PoolGrant,
    PoolGrantReply,
    PoolHeartbeatReply,
    PoolKeys,
    PoolReplicate,
    PoolSsdOrder,
    PoolSsdReply,
    PoolStoreRef,
    PoolStoreUpdate,
    chunk_records,
    epoch_ceiling,
)
from libs.common.service import BaseService
from libs.common.transfer import RegionDescriptor, TransferEngine, create_engine
from libs.common.transfer.rdma.exchange import engine_options, serve_connect
from services.cache_store.config import CacheStoreConfig
from services.cache_store.grants import GrantBook, expire, serve_grant
from services.cache_store.segment import StoreSegment, checksum
from services.cache_store.ssd import SsdTier
from services.cache_store.ssd_orders import report, serve_order

log = get_logger(__name__)

R = TypeVar("R", bound=Message)


class CacheStoreService(BaseService):
    """Contributes a memory segment to the pool; peers read and write it directly."""

    description = "Tandem cache store: a KV pool segment"

    def __init__(self, config: CacheStoreConfig):
        super().__init__(config)
        self.config: CacheStoreConfig = config
        self._engine: TransferEngine | None = None  # these three: set by on_start
        self._segment: StoreSegment | None = None
        self._region: RegionDescriptor | None = None
        self.mounted = False
        self.epoch = 0  # the highest master epoch seen
        self.grants = GrantBook()  # revoked when a higher epoch is followed
        self._update_seq = 0
        self._early: list[PoolStoreUpdate] | None = None  # updates that came mid-mount
        self._remount = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._sub: Any = None
        self.ssd: SsdTier | None = None
        self._ssd_reported = False  # the tier reported on the current mount
        self._mounts = 0  # mounts begun: an order is valid only on the mount it came under

    @property
    def engine(self) -> TransferEngine:
        if self._engine is None:
            raise RuntimeError("cache store not started: no transfer engine")
        return self._engine

    @property
    def segment(self) -> StoreSegment:
        if self._segment is None:
            raise RuntimeError("cache store not started: no segment")
        return self._segment

    @property
    def region(self) -> RegionDescriptor:
        if self._region is None:
            raise RuntimeError("cache store not started: segment not registered")
        return self._region

    def details(self) -> dict[str, Any]:
        engine, seg = self._engine, self._segment
        return {
            "segment_size": self.config.segment_bytes,
            "segment_file": self.config.segment_file,
            "transport": engine.transport if engine else self.config.transport,
            "transfer_endpoint": engine.endpoint if engine and self._region else "",
            "transfer": engine.info() if engine else {},
            "mounted": self.mounted,
            "epoch": self.epoch,
            "objects": len(seg.index) if seg else 0,
            "used": seg.used if seg else 0,
            "ssd_dir": self.config.ssd_dir,
            "ssd_objects": len(self.ssd.entries) if self.ssd else 0,
            "ssd_used": self.ssd.used if self.ssd else 0,
            "ssd_degraded_s": round(self.ssd.degraded(), 1) if self.ssd else 0.0,
            "ssd_write_errors": self.ssd.write_errors if self.ssd else 0,
        }

    def master(self, name: str) -> str:
        return self.subject("pool", "master", name)

    def endpoints(self) -> list[Endpoint]:
        subject = self.subject("pool", "store", self.config.service_id, "replicate")
        grant = self.subject("pool", "store", self.config.service_id, "grant")
        ssd = self.subject("pool", "store", self.config.service_id, "ssd")
        return [Endpoint("replicate", subject, PoolReplicate, self._replicate, concurrent=True),
                Endpoint("grant", grant, PoolGrant, self._grant),
                Endpoint("ssd", ssd, PoolSsdOrder, self._ssd_order)]  # fmt: skip

    async def _ssd_order(self, req: PoolSsdOrder) -> PoolSsdReply:
        """Spill, promote or remove on the SSD tier (ssd_orders.py); the master of my epoch
        only."""
        if req.epoch != self.epoch or not self.mounted or self.ssd is None:
            state = "" if self.ssd is not None else ", no SSD tier"
            raise HandlerError(409, f"ssd order of epoch {req.epoch}; this store follows "
                               f"{self.epoch}{state}")  # fmt: skip
        mount = self._mounts
        return await serve_order(self.ssd, self.segment.view, req,
                                 lambda: self.mounted and self._mounts == mount)  # fmt: skip

    async def _grant(self, req: PoolGrant) -> PoolGrantReply:
        """A capability for one put or get of the master's (grants.py)."""
        if req.epoch != self.epoch or not self.mounted:
            state = "" if self.mounted else ", not mounted"
            raise HandlerError(409, f"grant of epoch {req.epoch}; this store follows "
                               f"{self.epoch}{state}")  # fmt: skip
        reply = serve_grant(self.engine, self.region, req, self.segment.size)
        self.grants.forget(req.revoke)
        if req.mode:
            self.grants.add(reply, self.region, req.epoch, req.ttl)
        return reply

    async def on_start(self) -> None:
        options = self.config.transfer_options(self._transport())
        prefix, sid = self.config.subject_prefix, self.config.service_id
        options.update(engine_options(self._transport(), self.bus, prefix, sid))
        engine = self._engine = create_engine(self._transport(), **options)
        await engine.start()
        await serve_connect(self.bus, engine, prefix, sid)
        segment = self._segment = StoreSegment.open(
            engine, self.config.segment_bytes, self.config.segment_file
        )
        await asyncio.to_thread(segment.prefault)
        self._region = engine.register(segment.view)
        kept = await asyncio.to_thread(segment.load)
        if self.config.ssd_dir:
            self.ssd = SsdTier(self.config.ssd_dir, self.config.ssd_bytes,
                               self.config.ssd_retry_interval)  # fmt: skip
            dropped = await asyncio.to_thread(self.ssd.scan)
            log.info("ssd tier indexed", path=self.config.ssd_dir, objects=len(self.ssd.entries),
                     used=self.ssd.used, capacity=self.ssd.capacity, dropped=dropped)  # fmt: skip
        segment.replace(kept)
        if self.config.segment_file:
            log.info("segment file opened", path=self.config.segment_file, objects=len(kept))
        subject = self.subject("pool", "store", self.config.service_id, "update")
        self._sub = await self.bus.subscribe(subject, self._on_update)
        self._loop_task = asyncio.create_task(self._control_loop(), name="pool-control")

    def _transport(self) -> str:
        if self.config.transport == "auto":
            from libs.common.transfer import default_transport

            return default_transport()
        return self.config.transport

    async def on_stop(self) -> None:
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self.mounted and self.bus.connected:
            try:  # so the master stops sending readers here at once, not after a timeout
                ref = PoolStoreRef(self.config.service_id, self.region.region_id, epoch=self.epoch)
                await self.bus.request(self.master("unmount"), ref, PoolCount, timeout=2)
            except BusError as e:
                log.warning("unmount failed", error=str(e))
            self.mounted = False
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception as e:  # closed connection: nothing to unsubscribe from
                log.debug("unsubscribe failed", error=str(e))
        if self._segment is not None:
            self._segment.save(self._segment.snapshot())
        if self._engine is not None:
            await self._engine.stop()
        if self._segment is not None:
            self._segment.close()

    # --- keeping the master in sync ------------------------------------------------------

    async def _control_loop(self) -> None:
        interval = self.config.heartbeat_interval
        failures = 0
        while True:
            try:
                if not self.mounted or self._remount.is_set():
                    await self._mount()
                else:
                    await self._heartbeat()
                if self.mounted and not self._ssd_reported and not self._remount.is_set():
                    ref = {"store_id": self.config.service_id, "epoch": self.epoch}
                    await report(self.bus, self.master("ssd_report"), self.ssd, ref)
                    self._ssd_reported = True
                if failures:
                    log.info("cache master reachable again", after_failures=failures)
                failures = 0
            except BusError as e:
                if failures == 0:
                    log.warning("cache master unreachable; retrying", error=str(e))
                failures += 1
            except Exception:  # a bug here must not end the loop that keeps us mounted
                log.exception("pool control step failed")
            await asyncio.to_thread(self.segment.save, self.segment.snapshot())
            expire(self.engine)
            try:
                await asyncio.wait_for(self._remount.wait(), timeout=interval)
            except TimeoutError:
                pass

    async def _mount(self) -> None:
        """Mount in chunks; take the master's list (pages) and the updates sent meanwhile."""
        started = time.monotonic()
        self._mounts += 1  # before the master can hand out ranges of this mount
        chunks = chunk_records(list(self.segment.index.values()))
        sid, self._early = self.config.service_id, []
        try:
            begin = PoolMount(sid, self.region.to_dict(), chunks[0], epoch=self.epoch)
            reply = await self._ask("mount", begin, PoolMountReply)
            self._follow(reply.epoch)
            mount_id = reply.mount_id
            for index, chunk in enumerate(chunks[1:], 1):
                message = PoolMountChunk(sid, mount_id, index, chunk, epoch=self.epoch)
                await self._ask("mount_chunk", message, PoolCount)
            end = PoolMountEnd(sid, mount_id, len(chunks), sum(map(len, chunks)), self.epoch)
            reply = await self._ask("mount_end", end, PoolMountReply)
            records = list(reply.records)
            for page in range(1, reply.pages):
                ask = PoolMountPage(sid, mount_id, page, epoch=self.epoch)
                records += (await self._ask("mount_page", ask, PoolMountReply)).records
            early, self._early = self._early, None
        finally:
            self._early = None
        self._remount.clear()
        self._ssd_reported = False
        self.segment.replace(records)
        self._update_seq = reply.update_seq
        log.info("segment mounted", objects=len(records), rejected=reply.rejected,
                 size=self.segment.size, endpoint=self.engine.endpoint, chunks=len(chunks),
                 pages=reply.pages, epoch=self.epoch,
                 seconds=round(time.monotonic() - started, 3))  # fmt: skip
        self.mounted = True
        for update in sorted(early, key=lambda u: u.seq):
            self._apply(update)

    def _follow(self, epoch: int) -> None:
        """Take `epoch` (>= mine: `_ask` and `_heartbeat` refuse lower ones). A higher one
        is a new leader: the grants the old one asked for end now (grants.GrantBook)."""
        if epoch > self.epoch:
            revoked = self.grants.revoke_below(self.engine, epoch)
            if revoked:
                log.warning("grants of an older master revoked", revoked=revoked,
                            old_epoch=self.epoch, epoch=epoch)  # fmt: skip
        self.epoch = epoch

    async def _ask(self, name: str, message: Message, reply_type: type[R]) -> R:
        """A mount step; a reply from a master below the highest epoch seen is refused."""
        reply = await self.bus.request(self.master(name), message, reply_type)
        epoch = getattr(reply, "epoch", self.epoch)  # a chunk's PoolCount has none
        if epoch > epoch_ceiling(time.time_ns()):
            raise BusError(f"{name}: implausible master epoch {epoch}")
        if epoch < self.epoch:
            raise BusError(f"{name}: answered by a stale master (epoch {epoch} < "
                           f"{self.epoch})")  # fmt: skip
        return reply

    async def _heartbeat(self) -> None:
        ref = PoolStoreRef(self.config.service_id, self.region.region_id, self._update_seq,
                           epoch=self.epoch)  # fmt: skip
        timeout = self.config.heartbeat_interval
        reply = await self.bus.request(self.master("heartbeat"), ref, PoolHeartbeatReply, timeout)
        if reply.epoch < self.epoch or reply.epoch > epoch_ceiling(time.time_ns()):
            return  # a stale master answered (it stops serving when it sees our epoch)
        if reply.epoch > self.epoch:
            log.warning("a master with a higher epoch; mounting there", epoch=reply.epoch)
            self._follow(reply.epoch)
            self._remount.set()
        elif not reply.known:
            log.warning("cache master does not know this store; mounting again")
            self._remount.set()

    async def _on_update(self, msg: Msg) -> None:
        try:
            update = PoolStoreUpdate.decode(msg.data)
        except MessageError as e:
            log.warning("bad index update ignored", error=str(e))
            return
        if self._early is not None:
            self._early.append(update)  # mid-mount: applied after the master's list
            return
        # Anyone may publish here: an update of another epoch (stale, or a lie) is
        # ignored; a higher epoch is learnt only from a master's reply.
        self._apply(update)

    def _apply(self, update: PoolStoreUpdate) -> None:
        if update.epoch != self.epoch or update.seq <= self._update_seq:
            return  # another master's, or already in the mount's list
        if update.seq != self._update_seq + 1:
            log.warning("index update gap; mounting again", got=update.seq,
                        expected=self._update_seq + 1)  # fmt: skip
            self._remount.set()
            return
        self._update_seq = update.seq
        self.segment.apply(update.records, update.removed)

    # --- copies ordered by the master (re-replication) -----------------------------------

    async def _replicate(self, req: PoolReplicate) -> PoolKeys:
        """Copy each object from its source store into my segment; answer those whose
        bytes match their checksum. Only the master of the highest epoch may order it."""
        if req.epoch != self.epoch or not self.mounted:
            raise HandlerError(
                409,
                f"copy order of epoch {req.epoch}; this store follows "
                f"{self.epoch}" + ("" if self.mounted else " and is not mounted"),
            )
        size = self.segment.size
        by_source: dict[str, list[PoolCopy]] = {}
        for copy in req.copies:
            if copy.offset < 0 or copy.size <= 0 or copy.offset + copy.size > size:
                raise HandlerError(400, f"copy of {copy.key}: {copy.offset}+{copy.size} is "
                                   f"outside this segment ({size} bytes)")  # fmt: skip
            by_source.setdefault(copy.source, []).append(copy)
        copied: list[str] = []
        for source, copies in by_source.items():
            try:
                remote = RegionDescriptor.from_dict(req.segments[source])
                ops = [(c.offset, c.source_offset, c.size) for c in copies]
                await self.engine.read(self.region, remote, ops)
            except Exception as e:  # TransferError, OSError, a bad descriptor: skip it
                log.warning("copy from a store failed", source=source, error=str(e))
                continue
            view = self.segment.view
            copied += [c.key for c in copies
                       if checksum(view[c.offset : c.offset + c.size]) == c.checksum]  # fmt: skip
        return PoolKeys(copied)
