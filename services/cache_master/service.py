"""The cache master service: the pool's metadata behind NATS micro endpoints.

Every endpoint is `tandem.pool.master.<name>` in queue group `tandem-pool-master`. With
the election (ha/election.py, the default) only the leader has them: a standby answers
`info` alone until it wins, and a deposed leader stops serving and (run as a process)
exits, so that its supervisor starts it again as a fresh standby. The master holds no
bytes: it answers where to write and where to read; stores and clients
move the bytes with the transfer engine. After every change it publishes, per store,
a `PoolStoreUpdate` (the store's own index, so a restarted master can be told what each
store holds) and `KvEvent`s with tier `pool` (so the router knows what the pool holds).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from libs.common import __version__
from libs.common.bus.connection import Endpoint, HandlerError
from libs.common.bus.kv_events import keep_kv_stream
from libs.common.bus.permissions import election_bucket
from libs.common.log import get_logger
from libs.common.messages.control import InfoRequest, Message
from libs.common.messages.mounts import (
    PoolMount,
    PoolMountChunk,
    PoolMountEnd,
    PoolMountPage,
)
from libs.common.messages.pins import PoolPin, PoolPinList, PoolPinRef
from libs.common.messages.pool import (
    PoolCount,
    PoolDrop,
    PoolFound,
    PoolGetReply,
    PoolKeys,
    PoolPutFinish,
    PoolPutStart,
    PoolPutStartReply,
    PoolReplica,
    PoolSlot,
    PoolSsdReport,
    PoolStats,
    PoolStoreRef,
)
from libs.common.service import BaseService
from services.cache_master.config import CacheMasterConfig
from services.cache_master.ha.election import Claim, LeaderElection
from services.cache_master.ha.epoch import MasterEpoch
from services.cache_master.ha.repair import Repairer
from services.cache_master.metadata.metadata import PoolLimits, PoolMetadata
from services.cache_master.metadata.objects import Changes, PoolRequestError, PutSpec, Replica
from services.cache_master.metadata.reports import drop_bad
from services.cache_master.pins.book import PinLimits
from services.cache_master.pins.endpoints import Pinning
from services.cache_master.pins.saved import SavedPins
from services.cache_master.stores.announce import Announcer
from services.cache_master.stores.endpoints import StoreEndpoints
from services.cache_master.stores.grants import StoreGrants, by_store
from services.cache_master.stores.mounts import Mounts
from services.cache_master.tiers.ssd_index import exists, held_on_ssd, with_held
from services.cache_master.tiers.ssd_orders import SsdTiers

log = get_logger(__name__)

QUEUE_GROUP = "tandem-pool-master"
Handler = Callable[[Any], Awaitable[Message]]  # a request message -> its reply


class CacheMasterService(BaseService):
    """Keeps the pool's metadata in memory; stores and clients talk to it over NATS."""

    description = "Tandem cache master: KV pool metadata"

    def __init__(self, config: CacheMasterConfig, exit_on_step_down: bool = False):
        """`exit_on_step_down`: a deposed leader ends its process (SIGTERM to itself)."""
        super().__init__(config)
        self.exit_on_step_down = exit_on_step_down
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
        self.fence = MasterEpoch(self.bus, self.subject("pool", "master", "epoch"),
                                 config.service_id, self._on_fenced)  # fmt: skip
        self.fence.value = config.epoch  # 0: picked at start; an election may set it
        self.announce = Announcer(self.bus, config.subject_prefix, self.meta, lambda: self.epoch)
        self._sweeper: asyncio.Task[None] | None = None
        self._fence_task: asyncio.Task[None] | None = None
        self.grants = StoreGrants(self.bus, lambda sid: self.subject("pool", "store", sid, "grant"))
        self.repairer = Repairer(self.bus, self.meta, config.subject_prefix, self._publish_changes)
        self.ssd = SsdTiers(self.bus, self.meta, config.subject_prefix,
                            config.ssd_spill_watermark, self._publish_changes,
                            self.announce.publish_ssd)  # fmt: skip
        self.election = LeaderElection(self.bus, election_bucket(config.subject_prefix),
                                       config.service_id, config.election_lease,
                                       config.election_bucket_bytes)  # fmt: skip
        self.election.on_elected, self.election.on_deposed = self._lead, self._deposed
        self.election.on_resumed = lambda: log.info("serving the pool again", epoch=self.epoch)
        pin_limits = PinLimits(config.max_pinned_fraction, config.max_pins, config.max_pin_ttl)
        saved = (SavedPins(self.bus, self.election.bucket, config.election_bucket_bytes)
                 if config.elected else None)  # fmt: skip
        self.pinning = Pinning(self.meta, pin_limits, saved)  # soft pins (pins/endpoints.py)
        self.stores = StoreEndpoints(self.meta, self.mounts, self.fence, self.announce,
                                     self.pinning.refresh)  # fmt: skip
        self.serving = False  # the pool endpoints are up (leader, or no election)
        self._starting = False
        self._registered = asyncio.Event()  # start() has registered the micro service

    def details(self) -> dict[str, Any]:
        return {
            "heartbeat_timeout": self.config.heartbeat_timeout,
            "lease_ttl": self.config.lease_ttl,
            "replicas": self.config.replicas,
            "epoch": self.epoch,
            "role": self.role,
            "fenced_by": self.fence.fenced_by,
            "stores": len(self.meta.segments),
            "objects": len(self.meta.lru),
            "pins": len(self.pinning.book.pins),
        }

    @property
    def role(self) -> str:
        if self.fence.fenced_by:
            return "fenced"
        if not self.config.elected:
            return "single"
        return "leader" if self.serving else "standby"

    def endpoints(self) -> list[Endpoint]:
        """With the election, the pool's only when this master won (`_lead` adds them on a
        later win)."""
        return self.pool_endpoints() if self.serving or not self.config.elected else []

    def pool_endpoints(self) -> list[Endpoint]:
        handlers: dict[str, tuple[type[Message], Handler]] = {
            "mount": (PoolMount, self.stores.mount),
            "mount_chunk": (PoolMountChunk, self.stores.mount_chunk),
            "mount_end": (PoolMountEnd, self.stores.mount_end),
            "mount_page": (PoolMountPage, self.stores.mount_page),
            "unmount": (PoolStoreRef, self.stores.unmount),
            "heartbeat": (PoolStoreRef, self.stores.heartbeat),
            "put_start": (PoolPutStart, self._put_start),
            "put_end": (PoolPutFinish, self._put_end),
            "put_revoke": (PoolPutFinish, self._put_revoke),
            "get": (PoolKeys, self._get),
            "exists": (PoolKeys, self._exists),
            "remove": (PoolKeys, self._remove),
            "drop": (PoolDrop, self._drop),
            "stats": (InfoRequest, self._stats),
            "ssd_report": (PoolSsdReport, self._ssd_report),
            "pin": (PoolPin, self.pinning.pin),
            "unpin": (PoolPinRef, self.pinning.unpin),
            "pins": (PoolPinList, self.pinning.pins),
        }
        # Not concurrent: each endpoint serves its requests one at a time, in order; every
        # handler changes the index before its first await (the publishes of its changes).
        prefix = self.subject("pool", "master")
        return [
            Endpoint(name, f"{prefix}.{name}", kind, self._guarded(handler), QUEUE_GROUP)
            for name, (kind, handler) in handlers.items()
        ]

    async def on_start(self) -> None:
        try:
            await keep_kv_stream(self.bus, self.config.subject_prefix)
        except Exception as e:  # events still flow on core NATS without the stream
            log.warning("kv events stream unavailable", error=str(e) or type(e).__name__)
        if self.config.elected:
            log.info("standing by for the pool master election",
                     bucket=self.election.bucket, lease=self.config.election_lease)  # fmt: skip
            self._starting = True
            try:
                await self.election.start()  # a master that can win at once leads now
            finally:
                self._starting = False
        else:
            await self._begin_serving()

    async def start(self) -> None:
        await super().start()
        self._registered.set()

    async def _begin_serving(self) -> None:
        # Before the endpoints: a running master with a higher epoch fences this one
        # before any store could mount here.
        await self.fence.start()
        await self.pinning.load()  # a new leader keeps the saved pins (pins/saved.py)
        self.repairer.epoch = self.ssd.epoch = self.epoch
        log.info("master epoch", epoch=self.epoch)
        self._sweeper = asyncio.create_task(self._sweep_loop())
        self.serving = not self.fence.fenced_by

    async def _lead(self, epoch: int) -> None:
        """Won the election: serve the pool with `epoch` (above every earlier leader's).
        The metadata starts empty; the stores mount here at their next heartbeat."""
        self.fence.value = epoch
        await self._begin_serving()
        if self.fence.fenced_by or self._starting:
            return  # start() registers the endpoints
        await self._registered.wait()
        # One micro service per process (each would answer every `$SRV.PING`, and an
        # identity may send one response per request): `info` again, with the pool's.
        await self.bus.stop_services()
        info = Endpoint("info", self.subject(self.name, self.config.service_id, "info"),
                        InfoRequest, self._info)  # fmt: skip
        await self.bus.add_service(
            name=f"tandem-{self.name}", version=__version__, description=self.description,
            endpoints=[info, *self.pool_endpoints()],
            metadata={"service_id": self.config.service_id},
        )  # fmt: skip
        log.info("serving the pool as leader", epoch=epoch)

    def _deposed(self, claim: Claim | None) -> None:
        self.fence.fence(claim.epoch if claim else self.epoch + 1, "the election")

    async def on_stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        await self.repairer.stop()
        await self.ssd.stop()
        await self.election.stop()
        await self.fence.stop()

    # --- the epoch (ha/epoch.py) ---------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.fence.value

    def _on_fenced(self) -> None:
        """A higher epoch exists: stop serving and stop publishing (no more sweeps). An
        elected master also stops claiming; as a process it exits (a fresh standby is
        its supervisor's restart: its metadata is stale from now on)."""
        self.serving = False
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._fence_task = asyncio.create_task(self.bus.stop_services())
        if self.config.elected:
            self.election.abandon()
            if self.exit_on_step_down:
                os.kill(os.getpid(), signal.SIGTERM)

    def _guarded(self, handler: Handler) -> Handler:
        """`handler` behind the fence; the metadata's refusals become its error replies."""

        async def guarded(req: Any) -> Message:
            if not self.election.check_lease():  # lapsed: JetStream away past the lease
                raise HandlerError(503, "the master's lease lapsed; retry shortly")
            self.fence.check()  # requests queued before the endpoints went away
            try:
                return await handler(req)
            except PoolRequestError as e:
                raise HandlerError(e.code, e.message) from None

        return guarded

    # --- objects -------------------------------------------------------------------------

    async def _put_start(self, req: PoolPutStart) -> PoolPutStartReply:
        specs = [PutSpec(o.key, o.size, o.checksum, o.mac) for o in req.objects]
        held = held_on_ssd(self.meta, self.ssd.index, [spec.key for spec in specs])
        put_id, results = self.meta.put_start(
            [s for s in specs if s.key not in held], req.replicas, time.monotonic(), req.client
        )
        results = with_held([spec.key for spec in specs], results, held)
        await self._publish(self.meta.take_changes())  # evictions made room
        slots = [PoolSlot(status, _replicas(replicas)) for _, status, replicas in results]
        ranges = by_store([(r, spec.size) for spec, (_, _, replicas) in zip(specs, results,
                           strict=True) for r in replicas])  # fmt: skip
        ttl = self.config.put_timeout
        segments = await self.grants.issue(self.epoch, ranges, "write", ttl)
        self.grants.remember(put_id, segments, ttl)
        if len(segments) < len(ranges):  # a store did not grant: nothing of it is written
            await self.grants.end_put(self.epoch, put_id)
            self.meta.put_revoke(put_id, [spec.key for spec in specs])
            await self._publish(self.meta.take_changes())
            raise HandlerError(503, "a store did not grant access to its ranges; put revoked")
        return PoolPutStartReply(put_id, slots, segments, ttl, epoch=self.epoch)

    async def _put_end(self, req: PoolPutFinish) -> PoolKeys:
        visible = self.meta.put_end(req.put_id, req.keys)
        self.pinning.hold(visible)
        await self._publish(self.meta.take_changes())
        self.ssd.kick()
        await self.grants.end_put(self.epoch, req.put_id)  # no write lands after the reply
        return PoolKeys(visible)

    async def _put_revoke(self, req: PoolPutFinish) -> PoolCount:
        count = self.meta.put_revoke(req.put_id, req.keys)
        await self._publish(self.meta.take_changes())
        await self.grants.end_put(self.epoch, req.put_id)
        return PoolCount(count)

    async def _get(self, req: PoolKeys) -> PoolGetReply:
        promoting = await self.ssd.promote(req.keys)  # keys on SSD only: read into DRAM first
        looked = self.meta.get(req.keys, time.monotonic())  # leased before any other await
        if promoting:
            await self.ssd.published()
        found = [obj for _, obj, _ in looked if obj]
        ranges = by_store([(r, obj.size) for obj in found for r in obj.replicas])
        segments = await self.grants.issue(self.epoch, ranges, "read", self.config.lease_ttl)
        objects = [_found(obj, error, segments) for _, obj, error in looked]
        return PoolGetReply(objects, segments, self.config.lease_ttl)

    async def _exists(self, req: PoolKeys) -> PoolCount:
        return PoolCount(exists(self.meta, self.ssd.index, req.keys))

    async def _remove(self, req: PoolKeys) -> PoolCount:
        count = self.meta.remove(req.keys, time.monotonic())
        await self._publish(self.meta.take_changes())
        count += await self.ssd.remove(req.keys)
        return PoolCount(count)

    async def _drop(self, req: PoolDrop) -> PoolCount:
        """Replicas a reader found bad (metadata/reports.py: only exact matches count)."""
        count = drop_bad(self.meta, req.copies, time.monotonic())
        if count:
            log.warning("bad replicas dropped on a reader's report", count=count,
                        keys=[c.key for c in req.copies[:8]])  # fmt: skip
        await self._publish(self.meta.take_changes())
        self.repairer.kick()
        return PoolCount(count)

    async def _stats(self, _req: InfoRequest) -> PoolStats:
        return PoolStats(**self.meta.stats(), epoch=self.epoch,
                         ssd=self.ssd.index.stats(self.meta))  # fmt: skip

    async def _ssd_report(self, req: PoolSsdReport) -> PoolCount:
        """A store's SSD tier after its mount (tiers/ssd_orders.py)."""
        self.fence.seen(req.epoch, req.store_id)
        return PoolCount(await self.ssd.report(req))

    # --- helpers -------------------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval)
            if self.election.lapsed:
                continue  # no lease: nothing is published until it is renewed
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
        await self.pinning.sweep()  # expired pins hold nothing before the watermarks
        self.meta.enforce_watermarks(now)
        await self._publish(self.meta.take_changes())
        self.repairer.kick()
        await self.ssd.sweep()
        await self.fence.announce()

    async def _publish_changes(self) -> None:
        await self._publish(self.meta.take_changes())

    async def _publish(self, changes: Changes, update_stores: bool = True) -> None:
        await self.announce.publish(changes, update_stores)


def _replicas(replicas: list[Replica]) -> list[PoolReplica]:
    return [PoolReplica(r.store_id, r.offset) for r in replicas]


def _found(obj: Any, error: str, granted: dict[str, Any]) -> PoolFound:
    """get's answer for one key: only replicas on stores that granted reads of them."""
    if obj is None:
        return PoolFound(error=error)
    replicas = [r for r in obj.replicas if r.store_id in granted]
    if not replicas:
        return PoolFound(error="unavailable")
    return PoolFound(obj.size, obj.checksum, _replicas(replicas), mac=obj.mac)
