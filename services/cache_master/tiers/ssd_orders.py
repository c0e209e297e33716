"""The master's side of the stores' SSD tiers: spill rounds, promotions, removals, reports.

    spill     kicked after put_end and at every sweep: for each store with a tier whose
              DRAM use is above --ssd-spill-watermark, the coldest objects without an SSD
              copy (ssd_index.plan_spills) are sent in a `spill` order
              (`tandem.pool.store.<id>.ssd`); the store copies them to files while their
              DRAM ranges are still allocated to them, so no later put can overwrite them
              first; the keys it answers get an SSD copy (KvEvent `stored`, tier `ssd`).
              Eviction stays the metadata's: when it later drops such an object's DRAM
              replica (`removed`, tier `pool`), the object stays present on SSD.
    promote   a get of keys present on SSD only first reserves a range for each on the
              store that holds it (evicting there as a put would), orders a `promote` and
              awaits it; read-in keys become visible in DRAM (put_end: `stored`, tier
              `pool`, and the store's index update), the others are revoked (a miss).
              Then the get goes on as before (lease, read grant).
    remove    a client's remove forgets the keys' SSD copies and orders their files deleted.
    report    after each mount a store reports its whole tier (ssd_report, in chunks); the
              master replaces what it knew of that tier with it.
    sweep     tiers of stores no longer mounted are forgotten (`removed`, tier `ssd`).

Objects in a spill order are kept from eviction until it ends (`spilling_until`, which the
LRU walk skips like a lease), so the copy always finishes before their ranges can be
reused. A spill order that fails or times out changes nothing here (a later round retries
it). A store's tier drops its own oldest files when a spill needs room (--ssd-size); the
reply names them and the master forgets them. A store whose disk refused a write answers
`degraded` (seconds): no spill order goes there until then (DRAM only meanwhile).

A promotion that times out is a miss, but the store may still be reading the file and
write it into the reserved ranges later: those ranges stay allocated ("stranded", never
handed to another put) until the store answers a later order on the same endpoint, an
empty `remove` (the fence): the store serves its orders one at a time, in the order sent,
so that answer means the late promotion has ended. Until then no promotion or spill is
ordered there (it would only queue behind the stalled one): its SSD-only keys are misses
at once, so a disk that hangs strands one order's ranges, not one per get. The store also
checks, just before it copies into its segment, that it is still on the mount the order
came under.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable

from libs.common.bus.connection import Bus, BusError, HandlerError
from libs.common.log import get_logger
from libs.common.messages.pool import PoolRecord, PoolSsdOrder, PoolSsdReply, PoolSsdReport
from services.cache_master.metadata.metadata import PoolMetadata
from services.cache_master.metadata.objects import PoolObject, Segment
from services.cache_master.tiers.ssd_index import (
    Promotion,
    SsdCopy,
    SsdEvents,
    SsdIndex,
    plan_spills,
    reserve_promotions,
)

log = get_logger(__name__)

SPILL_TIMEOUT_S = 30.0
PROMOTE_TIMEOUT_S = 5.0
FENCE_TIMEOUT_S = 10.0  # a fence not answered in time is sent again at the next sweep
REPORT_IDLE_S = 30.0

# A report in chunks: when its last chunk came, how many it has, the next index, the
# records so far.
ReportSession = tuple[float, int, int, list[PoolRecord]]


class SsdTiers:
    """Drives the stores' SSD tiers for `meta`. `publish()` sends the metadata's changes
    (index updates, tier `pool` events); `publish_events(events)` the tier `ssd` events."""

    def __init__(self, bus: Bus, meta: PoolMetadata, prefix: str, watermark: float,
                 publish: Callable[[], Awaitable[None]],
                 publish_events: Callable[[SsdEvents], Awaitable[None]]):  # fmt: skip
        self.bus, self.meta, self.prefix, self.watermark = bus, meta, prefix, watermark
        self.publish, self.publish_events = publish, publish_events
        self.index = SsdIndex()
        meta.evict_first = self._spilled
        self.epoch = 0
        self._busy: dict[str, str] = {}  # key -> store, in a spill order now
        self._cancelled: set[str] = set()  # removed while being spilled
        self._reports: dict[str, ReportSession] = {}  # store -> its report in progress
        self._task: asyncio.Task[None] | None = None
        self._sent = itertools.count()  # orders sent, numbered (promotions and fences)
        # store -> (segment, offset, number of the promotion's order): ranges a timed-out
        # promotion may still write; freed when a fence sent after it is answered
        self._stranded: dict[str, list[tuple[Segment, int, int]]] = {}
        self._fences: dict[str, asyncio.Task[None]] = {}
        self._degraded: dict[str, float] = {}  # store -> no spill orders before (monotonic)

    # --- spills --------------------------------------------------------------------------

    def kick(self) -> None:
        """Start spill rounds unless running or no store has a tier."""
        if self.index.capacity and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(), name="pool-ssd-spill")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._fences.values()) if t is not None]
        self._task, self._fences = None, {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        for _ in range(1000):  # bounded: a later kick starts again
            try:
                if await self.spill_round() == 0:
                    return
            except Exception:  # a bug in a round must not stop the next kicks
                log.exception("ssd spill round failed")
                return

    async def spill_round(self) -> int:
        """One order per store with a tier and cold objects to spill; how many spilled."""
        orders: dict[str, list[PoolRecord]] = {}
        now = time.monotonic()
        for store_id in self.index.capacity:
            segment = self.meta.segments.get(store_id)
            if (segment is not None and self._degraded.get(store_id, 0.0) <= now
                    and store_id not in self._stranded):  # fmt: skip
                records = plan_spills(self.meta, self.index, segment, self.watermark,
                                      set(self._busy), now)  # fmt: skip
                if records:
                    orders[store_id] = records
                    self._busy.update((r.key, store_id) for r in records)
        if not orders:
            return 0
        held = self._hold([r for records in orders.values() for r in records])
        try:
            replies = await asyncio.gather(*(self._order(sid, "spill", records, SPILL_TIMEOUT_S)
                                             for sid, records in orders.items()))  # fmt: skip
        finally:
            self._release(held)
            for records in orders.values():
                for r in records:
                    self._busy.pop(r.key, None)
        spilled = 0
        removed: dict[str, list[PoolRecord]] = {}  # files written for keys removed meanwhile
        for (store_id, records), reply in zip(orders.items(), replies, strict=True):
            if reply is None:
                continue
            self._note_degraded(store_id, reply.degraded)
            done = set(reply.done)
            for r in records:
                if r.key in done and r.key in self._cancelled:  # a file for nothing
                    removed.setdefault(store_id, []).append(r)
                elif r.key in done and store_id in self.index.capacity:
                    self.index.add(store_id, r.key, SsdCopy(r.size, r.checksum, r.mac))
                    spilled += 1
            self._forget(store_id, reply.dropped)
        self._cancelled.difference_update(r.key for rs in orders.values() for r in rs)
        self.index.spilled += spilled
        await self.publish_events(self.index.take_events())
        for store_id, records in removed.items():
            await self._order(store_id, "remove", records)
        return spilled

    def _spilled(self, obj: PoolObject, segment: Segment) -> bool:
        """Eviction takes objects with an SSD copy on the store first: they stay present."""
        return segment.store_id in self.index.copies.get(obj.key, ())

    def _hold(self, records: list[PoolRecord]) -> list[PoolObject]:
        """Keep the objects being spilled from eviction until the order ends, so their
        ranges are not freed and written again under the store's copy."""
        until = time.monotonic() + SPILL_TIMEOUT_S
        held = [obj for r in records if (obj := self.meta.objects.get(r.key)) is not None]
        for obj in held:
            obj.spilling_until = until
        return held

    @staticmethod
    def _release(held: list[PoolObject]) -> None:
        for obj in held:
            obj.spilling_until = 0.0

    # --- promotions (a get) --------------------------------------------------------------

    async def promote(self, keys: list[str]) -> int:
        """Bring the keys present on SSD only into DRAM before a get looks them up.

        Returns how many it tried, with no await after the objects became visible: the
        caller leases them (its metadata.get) before anything else runs, so no eviction can
        take them first; then, if it tried any, it calls `published()` to send the changes
        (a failed promotion may have evicted to make room)."""
        if not self.index.copies:
            return 0
        now = time.monotonic()
        # Pending until the order ends: never reclaimed as an unfinished put before that.
        deadline = now + PROMOTE_TIMEOUT_S + self.meta.limits.put_timeout
        # A store with a promotion unanswered is still busy with it (one order at a time):
        # a new one would only wait behind it and strand more DRAM; a miss at once instead.
        promotions = reserve_promotions(self.meta, self.index, keys, now, deadline,
                                        skip=self._stranded)  # fmt: skip
        if not promotions:
            return 0
        numbers = [next(self._sent) for _ in promotions]
        asks = [self._order(p.store_id, "promote", p.records, PROMOTE_TIMEOUT_S)
                for p in promotions]  # fmt: skip
        replies = await asyncio.gather(*asks)
        promoted = 0
        for promotion, number, reply in zip(promotions, numbers, replies, strict=True):
            if reply is None:  # the store may still write these ranges: hold them
                self._strand(promotion, number)
                continue
            done = set(reply.done)
            keys_in = [r.key for r in promotion.records]
            promoted += len(self.meta.put_end(promotion.put_id, [k for k in keys_in if k in done]))
            self.meta.put_revoke(promotion.put_id, [k for k in keys_in if k not in done])
            self._forget(promotion.store_id, reply.dropped)
        self.index.promoted += promoted
        return sum(len(p.records) for p in promotions)

    def _strand(self, promotion: Promotion, number: int) -> None:
        """A promotion order that got no answer: its keys are misses (SSD only again), its
        ranges stay allocated, out of the metadata's objects, until a fence frees them."""
        segment = self.meta.segments.get(promotion.store_id)
        if segment is None:
            return  # the store is gone: its whole allocator went with it
        held = self._stranded.setdefault(promotion.store_id, [])
        for record in promotion.records:
            obj = self.meta.objects.get(record.key)
            if obj is None or obj.complete or obj.put_id != promotion.put_id:
                continue
            replica = obj.on(promotion.store_id)
            if replica is not None:
                self.meta.drop_replica(obj, segment, free=False)  # still allocated
                held.append((segment, replica.offset, number))
        if not held:
            del self._stranded[promotion.store_id]
            return
        self.index.stranded = sum(map(len, self._stranded.values()))
        log.warning("ssd promotion unanswered; its ranges are held until the store answers "
                    "a fence", store=promotion.store_id, ranges=len(held))  # fmt: skip
        self._fence_later(promotion.store_id)

    def _fence_later(self, store_id: str) -> None:
        task = self._fences.get(store_id)
        if self._stranded.get(store_id) and (task is None or task.done()):
            self._fences[store_id] = asyncio.create_task(self._fence(store_id),
                                                         name="pool-ssd-fence")  # fmt: skip

    async def _fence(self, store_id: str) -> None:
        """An empty `remove` order; its answer frees the ranges stranded by every promotion
        order sent before it (the store serves orders one at a time, in order)."""
        number = next(self._sent)
        if await self._order(store_id, "remove", [], FENCE_TIMEOUT_S) is None:
            return  # the sweep sends another
        held = self._stranded.pop(store_id, [])
        keep = [h for h in held if h[2] > number]
        segment = self.meta.segments.get(store_id)
        for owner, offset, _ in (h for h in held if h[2] < number):
            if owner is segment:  # not a segment mounted since (a new allocator)
                owner.allocator.free(offset)
        if keep:
            self._stranded[store_id] = keep
        self.index.stranded = sum(map(len, self._stranded.values()))
        log.info("ssd ranges of unanswered promotions freed", store=store_id,
                 ranges=len(held) - len(keep))  # fmt: skip

    async def published(self) -> None:
        """After a get's promotions: index updates and tier `pool` events of what they made
        visible (and evicted), tier `ssd` events of files a store dropped."""
        await self.publish()
        await self.publish_events(self.index.take_events())
        self.kick()

    # --- removals, reports, lost stores --------------------------------------------------

    async def remove(self, keys: list[str]) -> int:
        """A client removed `keys`: forget their SSD copies, order their files deleted."""
        by_store: dict[str, list[PoolRecord]] = {}
        for key in keys:
            if key in self._busy:
                self._cancelled.add(key)
            for store_id, copy in list(self.index.copies.get(key, {}).items()):
                self.index.discard(store_id, key)
                by_store.setdefault(store_id, []).append(
                    PoolRecord(key, 0, copy.size, copy.checksum, copy.mac)
                )
        await self.publish_events(self.index.take_events())
        await asyncio.gather(*(self._order(sid, "remove", records)
                               for sid, records in by_store.items()))  # fmt: skip
        return sum(map(len, by_store.values()))

    async def report(self, req: PoolSsdReport) -> int:
        """One chunk of a store's report; the tier is replaced at the last chunk."""
        if req.store_id not in self.meta.segments:
            raise HandlerError(409, f"ssd report of {req.store_id!r}: not mounted")
        now = time.monotonic()
        session: ReportSession | None
        if req.index == 0:
            session = (now, req.chunks, 0, [])
        else:
            session = self._reports.pop(req.store_id, None)
            if session is None or session[2] != req.index or session[1] != req.chunks:
                raise HandlerError(409, f"ssd report of {req.store_id!r}: chunk {req.index} "
                                   "out of order; report again")  # fmt: skip
        records = session[3] + list(req.records)
        if req.index + 1 < req.chunks:
            self._reports[req.store_id] = (now, req.chunks, req.index + 1, records)
            return len(records)
        self._reports.pop(req.store_id, None)
        refused = self.index.replace(req.store_id, req.capacity, records)
        log.info("ssd tier reported", store=req.store_id, objects=len(records) - refused,
                 refused=refused, capacity=req.capacity)  # fmt: skip
        await self.publish_events(self.index.take_events())
        self.kick()
        return len(records)

    async def sweep(self) -> None:
        """Forget the tiers of stores no longer mounted, and idle report sessions; fence
        again where ranges are still stranded."""
        now = time.monotonic()
        for store_id in [s for s in self.index.by_store if s not in self.meta.segments]:
            self.index.drop_store(store_id)
        for store_id in [s for s in self.index.capacity if s not in self.meta.segments]:
            self.index.capacity.pop(store_id, None)
        for store_id in list(self._stranded):
            if store_id in self.meta.segments:
                self._fence_later(store_id)
            else:  # gone: its allocator with it
                del self._stranded[store_id]
        self.index.stranded = sum(map(len, self._stranded.values()))
        self._degraded = {s: t for s, t in self._degraded.items() if t > now}
        self.index.degraded = len(self._degraded)
        for store_id in [s for s, r in self._reports.items() if now - r[0] > REPORT_IDLE_S]:
            del self._reports[store_id]
        await self.publish_events(self.index.take_events())
        self.kick()

    # --- helpers -------------------------------------------------------------------------

    def _note_degraded(self, store_id: str, seconds: float) -> None:
        """A store whose disk refused a write: no spill orders for `seconds`."""
        if seconds > 0:
            if store_id not in self._degraded:
                log.warning("ssd tier degraded: DRAM only there for a while", store=store_id,
                            seconds=round(seconds, 1))  # fmt: skip
            self._degraded[store_id] = time.monotonic() + min(seconds, 3600.0)
        else:
            self._degraded.pop(store_id, None)
        self.index.degraded = len(self._degraded)

    def _forget(self, store_id: str, keys: list[str]) -> None:
        for key in keys:
            self.index.dropped += self.index.discard(store_id, key)

    async def _order(self, store_id: str, op: str, records: list[PoolRecord],
                     timeout: float = SPILL_TIMEOUT_S) -> PoolSsdReply | None:  # fmt: skip
        subject = f"{self.prefix}.pool.store.{store_id}.ssd"
        try:
            return await self.bus.request(subject, PoolSsdOrder(self.epoch, op, records),
                                          PoolSsdReply, timeout)  # fmt: skip
        except BusError as e:
            log.warning("ssd order failed", store=store_id, op=op, objects=len(records),
                        error=str(e))  # fmt: skip
            return None
