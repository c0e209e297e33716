"""The stores' endpoints on the master: `mount` (in chunks: `mount_chunk`, `mount_end`,
then `mount_page`; mounts.py), `unmount` and `heartbeat`.

Every request carries the highest master epoch its store has seen (`fence.seen`: a master
below it stops serving). A mount changes nothing until its end; then the metadata takes
every record at once (no await in between) and the store reads the master's list of what
it now holds back in pages. A `PoolRequestError` raised here becomes the error reply of
the endpoint (the service's guard).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from libs.common.bus.connection import HandlerError
from libs.common.log import get_logger
from libs.common.messages.mounts import (
    PoolMount,
    PoolMountChunk,
    PoolMountEnd,
    PoolMountPage,
    PoolMountReply,
)
from libs.common.messages.pool import PoolCount, PoolHeartbeatReply, PoolRecord, PoolStoreRef
from libs.common.transfer import RegionDescriptor
from services.cache_master.ha.epoch import MasterEpoch
from services.cache_master.metadata.metadata import PoolMetadata
from services.cache_master.stores.announce import Announcer
from services.cache_master.stores.mounts import Mounts, MountSession

log = get_logger(__name__)


class StoreEndpoints:
    """Handlers of the stores' requests. `on_mounted()` runs after a mount is applied, before
    its changes are published (the pins hold adopted objects under pinned keys again)."""

    def __init__(
        self,
        meta: PoolMetadata,
        mounts: Mounts,
        fence: MasterEpoch,
        announce: Announcer,
        on_mounted: Callable[[], None],
    ) -> None:
        self.meta, self.mounts, self.fence, self.announce = meta, mounts, fence, announce
        self.on_mounted = on_mounted

    async def mount(self, req: PoolMount) -> PoolMountReply:
        """Begin a mount: nothing changes until its end."""
        self.fence.seen(req.epoch, req.store_id)
        if not req.store_id:
            raise HandlerError(400, "store_id: required")
        try:
            RegionDescriptor.from_dict(req.segment)
        except ValueError as e:
            raise HandlerError(400, f"segment: {e}") from None
        session = self.mounts.begin(req.store_id, req.segment, req.records, time.monotonic())
        return PoolMountReply(epoch=self.fence.value, mount_id=session.mount_id)

    async def mount_chunk(self, req: PoolMountChunk) -> PoolCount:
        self.fence.seen(req.epoch, req.store_id)
        now = time.monotonic()
        session = self.mounts.chunk(req.store_id, req.mount_id, req.index, req.records, now)
        # A long mount of a store already mounted (a re-mount after a gap) keeps it alive.
        self.meta.heartbeat(req.store_id, int(session.descriptor.get("region_id", 0)), now)
        return PoolCount(len(session.records))

    async def mount_end(self, req: PoolMountEnd) -> PoolMountReply:
        """All chunks in: mount with every record at once, answer page 0 of the list."""
        self.fence.seen(req.epoch, req.store_id)
        now = time.monotonic()
        session = self.mounts.end(req.store_id, req.mount_id, req.chunks, req.records, now)
        segment, rejected = self.meta.mount(req.store_id, session.descriptor, session.records,
                                            now)  # fmt: skip
        records = []
        for key in sorted(segment.keys):
            obj = self.meta.objects.get(key)
            replica = obj.on(req.store_id) if obj is not None else None
            if obj is not None and obj.complete and replica is not None:
                records.append(PoolRecord(key, replica.offset, obj.size, obj.checksum, obj.mac))
        session.rejected = rejected
        self.on_mounted()
        self.mounts.finish(session, records, segment.update_seq)
        log.info("store mounted", store=req.store_id, objects=len(records), rejected=rejected,
                 capacity=segment.capacity, chunks=req.chunks)  # fmt: skip
        # The store takes the records from the pages; events only, no index update.
        await self.announce.publish(self.meta.take_changes(), update_stores=False)
        reply = self._page(session, 0)
        if reply.pages == 1:
            self.mounts.done(session)
        return reply

    async def mount_page(self, req: PoolMountPage) -> PoolMountReply:
        self.fence.seen(req.epoch, req.store_id)
        session = self.mounts.page(req.store_id, req.mount_id, req.page, time.monotonic())
        return self._page(session, req.page)

    def _page(self, session: MountSession, page: int) -> PoolMountReply:
        pages = session.listed()
        return PoolMountReply(pages[page], session.rejected, session.update_seq,
                              epoch=self.fence.value, mount_id=session.mount_id, page=page,
                              pages=len(pages))  # fmt: skip

    async def unmount(self, req: PoolStoreRef) -> PoolCount:
        self.fence.seen(req.epoch, req.store_id)
        if not self.meta.unmount(req.store_id):
            raise HandlerError(404, f"unknown store segment {req.store_id!r}")
        log.info("store unmounted", store=req.store_id)
        await self.announce.publish(self.meta.take_changes())
        return PoolCount(1)

    async def heartbeat(self, req: PoolStoreRef) -> PoolHeartbeatReply:
        self.fence.seen(req.epoch, req.store_id)
        segment = self.meta.heartbeat(req.store_id, req.region_id, time.monotonic())
        epoch = self.fence.value
        if segment is None:
            return PoolHeartbeatReply(known=False, epoch=epoch)
        return PoolHeartbeatReply(known=True, update_seq=segment.update_seq, epoch=epoch)
