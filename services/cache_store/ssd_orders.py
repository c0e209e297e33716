"""The master's orders for a store's SSD tier (PoolSsdOrder) and the store's report of it.

    spill    the master chose cold objects of my DRAM segment (still allocated there):
             for each, make room under --ssd-size (oldest files first), copy its bytes
             in a thread, check the checksum over the copy, write its file; a write the
             disk refuses degrades the tier (ssd.py) and ends the order: what was written
             is answered, the rest stays in DRAM only, the reply says for how long
    promote  a get wants objects my tier holds: read each file in a thread, checking its
             header and checksum, into the range of my segment the master reserved,
             unless the order is no longer valid by then (`valid`: the store's mount)
    remove   the objects were removed from the pool: delete their files (an empty one is
             the master's fence, answered at once)

Orders run one at a time (the endpoint is not concurrent), so a key is never spilled and
promoted at once, and an answer means every earlier order has ended. The reply's
`dropped` tells the master which keys the tier lost.
After every mount the store reports its whole tier in chunks (`report`), so a restarted
master, or a master that mounted a restarted store, knows what the SSD holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from libs.common.bus.connection import Bus, HandlerError
from libs.common.log import get_logger
from libs.common.messages.pool import (
    PoolCount,
    PoolRecord,
    PoolSsdOrder,
    PoolSsdReply,
    PoolSsdReport,
    chunk_records,
)
from services.cache_store.ssd import SsdEntry, SsdTier

log = get_logger(__name__)


async def serve_order(
    tier: SsdTier, view: memoryview, req: PoolSsdOrder, valid: Callable[[], bool] = lambda: True
) -> PoolSsdReply:
    """Carry out one order (the caller has checked the epoch; `valid()` says whether the
    store is still on the mount the order came under)."""
    if req.op in ("spill", "promote"):
        for r in req.records:
            if r.offset < 0 or r.size <= 0 or r.offset + r.size > view.nbytes:
                raise HandlerError(400, f"ssd {req.op} of {r.key}: {r.offset}+{r.size} is "
                                   f"outside the segment ({view.nbytes} bytes)")  # fmt: skip
    if req.op == "spill":
        return await _spill(tier, view, req.records)
    if req.op == "promote":
        return await _promote(tier, view, req.records, valid)
    if req.op == "remove":
        keys = [r.key for r in req.records if tier.forget(r.key) is not None]
        if keys:
            await asyncio.to_thread(tier.unlink, keys)
        return PoolSsdReply(done=keys, degraded=tier.degraded())
    raise HandlerError(400, f"ssd: unknown op {req.op!r}")


async def _spill(tier: SsdTier, view: memoryview, records: list[PoolRecord]) -> PoolSsdReply:
    done = [r.key for r in records if r.key in tier.entries]  # already there: same key, bytes
    if tier.degraded():
        return PoolSsdReply(done=done, degraded=tier.degraded())
    keep = {r.key for r in records}
    dropped: list[str] = []
    for record in [r for r in records if r.key not in tier.entries]:
        freed = tier.reserve(record.size, keep)  # room for this one only, just before it
        if freed is None:
            continue  # larger than the tier, or the rest of the tier is this batch
        dropped += freed
        tier.used += record.size  # held until the write is done
        try:
            entry = await asyncio.to_thread(_write, tier, view, record, freed)
        except OSError as e:  # disk full, read-only, failing: DRAM only for a while
            tier.fail(e)
            entry = None
        finally:
            tier.used -= record.size
        if entry is not None:
            tier.add(record.key, entry)
            tier.recovered()
            done.append(record.key)
        elif tier.degraded():
            break
    return PoolSsdReply(done=done, dropped=dropped, degraded=tier.degraded())


def _write(
    tier: SsdTier, view: memoryview, record: PoolRecord, freed: list[str]
) -> SsdEntry | None:
    """Delete the files `record` displaces, then write its own (a thread)."""
    tier.unlink(freed)
    return tier.spill_io(view, record)


async def _promote(tier: SsdTier, view: memoryview, records: list[PoolRecord],
                   valid: Callable[[], bool]) -> PoolSsdReply:  # fmt: skip
    done: list[str] = []
    dropped: list[str] = []
    for record in records:
        if record.key not in tier.entries:
            dropped.append(record.key)
            continue
        result = await asyncio.to_thread(tier.promote_io, view, record, valid)
        if result == "done":
            tier.touch(record.key)
            done.append(record.key)
        elif result == "stale":
            log.info("ssd promotion not written: the store mounted again since the order",
                     key=record.key)  # fmt: skip
        else:
            log.warning("ssd file dropped: missing, or bad header or checksum", key=record.key)
            tier.forget(record.key)
            dropped.append(record.key)
    return PoolSsdReply(done=done, dropped=dropped, degraded=tier.degraded())


async def report(bus: Bus, subject: str, tier: SsdTier | None, ref: dict[str, Any]) -> None:
    """Send the whole tier to the master in chunks (`ref`: store_id, epoch). Raises
    BusError when the master did not take it (the caller tries again later)."""
    records = tier.records() if tier is not None else []
    capacity = tier.capacity if tier is not None else 0
    chunks = chunk_records(records)
    for index, chunk in enumerate(chunks):
        message = PoolSsdReport(ref["store_id"], index, len(chunks), capacity, chunk,
                                epoch=ref["epoch"])  # fmt: skip
        await bus.request(subject, message, PoolCount)
