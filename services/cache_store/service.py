"""The cache store service: one registered segment, mounted on the master, kept in sync.

    start:  transfer engine up -> segment (anonymous or --segment-file) registered ->
            saved index verified (segment file) -> subscribe to my index updates ->
            control loop: mount (retrying until a master answers), then heartbeats
    loop:   heartbeat every --heartbeat-interval; `known: false` (the master restarted
            or timed us out) or a gap in update numbers -> mount again, reporting what
            this store holds; the master answers with the authoritative list
    stop:   unmount (clients stop being sent here), save the index, stop the engine

Peers never ask this service for bytes over NATS: they read and write the segment
directly through the transfer engine, with the descriptor the master hands out.
"""

from __future__ import annotations

import asyncio
from typing import Any

from nats.aio.msg import Msg

from libs.common.bus.connection import BusError
from libs.common.log import get_logger
from libs.common.messages.control import MessageError
from libs.common.messages.pool import (
    PoolCount,
    PoolHeartbeatReply,
    PoolMount,
    PoolMountReply,
    PoolStoreRef,
    PoolStoreUpdate,
)
from libs.common.service import BaseService
from libs.common.transfer import RegionDescriptor, TransferEngine, create_engine
from libs.common.transfer.rdma.exchange import engine_options, serve_connect
from services.cache_store.config import CacheStoreConfig
from services.cache_store.segment import StoreSegment

log = get_logger(__name__)


class CacheStoreService(BaseService):
    """Contributes a memory segment to the pool; peers read and write it directly."""

    description = "Tandem cache store: a KV pool segment"

    def __init__(self, config: CacheStoreConfig):
        super().__init__(config)
        self.config: CacheStoreConfig = config
        self.engine: TransferEngine | None = None
        self.segment: StoreSegment | None = None
        self.region: RegionDescriptor | None = None
        self.mounted = False
        self._update_seq = 0
        self._remount = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._sub: Any = None

    def details(self) -> dict[str, Any]:
        seg = self.segment
        return {
            "segment_size": self.config.segment_bytes,
            "segment_file": self.config.segment_file,
            "transport": self.engine.transport if self.engine else self.config.transport,
            "transfer_endpoint": self.engine.endpoint if self.engine and self.region else "",
            "transfer": self.engine.info() if self.engine else {},
            "mounted": self.mounted,
            "objects": len(seg.index) if seg else 0,
            "used": seg.used if seg else 0,
        }

    def master(self, name: str) -> str:
        return self.subject("pool", "master", name)

    async def on_start(self) -> None:
        options = self.config.transfer_options(self._transport())
        prefix, sid = self.config.subject_prefix, self.config.service_id
        options.update(engine_options(self._transport(), self.bus, prefix, sid))
        self.engine = create_engine(self._transport(), **options)
        await self.engine.start()
        await serve_connect(self.bus, self.engine, prefix, sid)
        self.segment = StoreSegment.open(
            self.engine, self.config.segment_bytes, self.config.segment_file
        )
        await asyncio.to_thread(self.segment.prefault)
        self.region = self.engine.register(self.segment.view)
        kept = await asyncio.to_thread(self.segment.load)
        self.segment.replace(kept)
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
                ref = PoolStoreRef(self.config.service_id, self.region.region_id)
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
        if self.segment is not None:
            self.segment.save(self.segment.snapshot())
        if self.engine is not None:
            await self.engine.stop()
        if self.segment is not None:
            self.segment.close()

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
            try:
                await asyncio.wait_for(self._remount.wait(), timeout=interval)
            except TimeoutError:
                pass

    async def _mount(self) -> None:
        request = PoolMount(self.config.service_id, self.region.to_dict(),
                            list(self.segment.index.values()))  # fmt: skip
        reply = await self.bus.request(self.master("mount"), request, PoolMountReply)
        self._remount.clear()
        self.segment.replace(reply.records)
        self._update_seq = reply.update_seq
        if not self.mounted:
            log.info("segment mounted", objects=len(reply.records), rejected=reply.rejected,
                     size=self.segment.size, endpoint=self.engine.endpoint)  # fmt: skip
        self.mounted = True

    async def _heartbeat(self) -> None:
        ref = PoolStoreRef(self.config.service_id, self.region.region_id, self._update_seq)
        timeout = self.config.heartbeat_interval
        reply = await self.bus.request(self.master("heartbeat"), ref, PoolHeartbeatReply, timeout)
        if not reply.known:
            log.warning("cache master does not know this store; mounting again")
            self._remount.set()

    async def _on_update(self, msg: Msg) -> None:
        try:
            update = PoolStoreUpdate.decode(msg.data)
        except MessageError as e:
            log.warning("bad index update ignored", error=str(e))
            return
        if update.seq <= self._update_seq:
            return  # already in the mount reply
        if update.seq != self._update_seq + 1:
            log.warning("index update gap; mounting again", got=update.seq,
                        expected=self._update_seq + 1)  # fmt: skip
            self._remount.set()
            return
        self._update_seq = update.seq
        self.segment.apply(update.records, update.removed)
