"""Re-replication: after a store is lost, copy its objects back up to their replica count.

    sweep declares store X dead -> objects it held with fewer replicas than asked for are
    marked (metadata.under_replicated) -> a round: reserve a range on another store for
    each (repair_plan.plan_repairs) -> ask each target store to copy them from a surviving replica
    (request `tandem.pool.store.<target>.replicate`, PoolReplicate; the store reads with
    its transfer engine and checks each checksum) -> add the replicas it copied, free the
    ranges of the others (finish_repair) -> publish the stores' index updates.

The master moves no bytes. Rounds run one at a time, in a task the sweep starts; a round
that copies nothing ends the task until the next sweep.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from libs.common.bus.connection import Bus, BusError
from libs.common.log import get_logger
from libs.common.messages.pool import PoolCopy, PoolKeys, PoolReplicate
from services.cache_master.ha.repair_plan import Repair, finish_repair, plan_repairs
from services.cache_master.metadata.metadata import PoolMetadata

log = get_logger(__name__)

ROUND_OBJECTS = 256  # objects per round (and at most per copy request)
COPY_TIMEOUT_S = 30.0


class Repairer:
    """Runs repair rounds for `meta`; `publish()` sends the changes each round made."""

    def __init__(self, bus: Bus, meta: PoolMetadata, prefix: str,
                 publish: Callable[[], Awaitable[None]]):  # fmt: skip
        self.bus, self.meta, self.prefix, self.publish = bus, meta, prefix, publish
        self.epoch = 0
        self._task: asyncio.Task[None] | None = None

    def kick(self) -> None:
        """Start rounds unless running or nothing to do."""
        if self.meta.under_replicated and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(), name="pool-repair")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while self.meta.under_replicated:
            try:
                copied = await self.round()
            except Exception:  # a bug in a round must not leave ranges reserved forever
                log.exception("repair round failed")
                return
            if copied == 0:
                return  # nothing could be copied now; the next sweep tries again

    async def round(self) -> int:
        planned = plan_repairs(self.meta, time.monotonic(), ROUND_OBJECTS)
        by_target: dict[str, list[Repair]] = {}
        for repair in planned:
            by_target.setdefault(repair.target.store_id, []).append(repair)
        results = await asyncio.gather(*(self._copy(sid, rs) for sid, rs in by_target.items()))
        copied = 0
        for repairs, keys in zip(by_target.values(), results, strict=True):
            for repair in repairs:
                copied += finish_repair(self.meta, repair, repair.obj.key in keys)
        await self.publish()
        if planned:
            log.info("objects re-replicated", copied=copied, planned=len(planned),
                     left=len(self.meta.under_replicated))  # fmt: skip
        return copied

    async def _copy(self, store_id: str, repairs: list[Repair]) -> set[str]:
        """Ask `store_id` to copy `repairs`; the keys it copied (none if it failed)."""
        copies, segments = [], {}
        for r in repairs:
            source = self.meta.segments.get(r.source.store_id)
            if source is None:
                continue  # the source went too; finish_repair frees the range
            segments[source.store_id] = source.descriptor
            copies.append(PoolCopy(r.obj.key, r.obj.size, r.obj.checksum, r.offset,
                                   source.store_id, r.source.offset))  # fmt: skip
        if not copies:
            return set()
        subject = f"{self.prefix}.pool.store.{store_id}.replicate"
        try:
            reply = await self.bus.request(subject, PoolReplicate(self.epoch, copies, segments),
                                           PoolKeys, COPY_TIMEOUT_S)  # fmt: skip
        except BusError as e:
            log.warning("re-replication copy failed", store=store_id, error=str(e))
            return set()
        return set(reply.keys)
