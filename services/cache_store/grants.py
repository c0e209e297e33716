"""Capabilities on this store's segment, for the master's puts and gets (PoolGrant).

Clients never get the segment's own descriptor: the master asks here for a grant per put
(writes of its allocated ranges, until put_end/put_revoke, at most the put timeout) and
per get (reads of its replicas' ranges, for the lease), and hands that descriptor on.
tcp enforces each grant's ranges and mode on every op (TransferEngine.grant); shm gives it
its own slot (revocable; ranges checked by peers' code only) and, when every slot is in
use, the segment's descriptor; rdma cannot narrow an rkey: the segment's descriptor
(docs/pool.md, "Capabilities").
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from libs.common.bus.connection import HandlerError
from libs.common.log import get_logger
from libs.common.messages.pool import PoolGrant, PoolGrantReply
from libs.common.transfer import RegionDescriptor, TransferEngine
from libs.common.transfer.errors import RegionBusy

log = get_logger(__name__)

MAX_TTL_S = 3600.0
_warned: list[bool] = []  # the shm fallback is logged once per process


def serve_grant(
    engine: TransferEngine, segment: RegionDescriptor, req: PoolGrant, size: int
) -> PoolGrantReply:
    """Revoke `req.revoke`, then grant `req.ranges` when asked (HandlerError 400 on bad
    input; the caller has checked the epoch)."""
    revoked = 0
    for region_id in req.revoke:
        if region_id != segment.region_id:  # never the segment itself
            engine.revoke(region_id)
            revoked += 1
    if not req.mode:
        return PoolGrantReply(revoked=revoked)
    if req.mode not in ("read", "write") or not 0 < req.ttl <= MAX_TTL_S:
        raise HandlerError(400, f"grant: mode {req.mode!r} / ttl {req.ttl} not allowed")
    ranges = _ranges(req.ranges, size)
    if engine.transport == "rdma":
        return PoolGrantReply(segment.to_dict(), revoked)
    try:
        return PoolGrantReply(engine.grant(segment, ranges, req.mode, req.ttl).to_dict(), revoked)
    except ValueError as e:
        if engine.transport != "shm":
            raise HandlerError(400, f"grant: {e}") from None
        if not _warned:
            _warned.append(True)
            log.warning("shm grant slots exhausted: the segment's descriptor is handed out "
                        "while they are (logged once)", error=str(e))  # fmt: skip
        return PoolGrantReply(segment.to_dict(), revoked)


def _ranges(ranges: list[list[int]], size: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for pair in ranges:
        if len(pair) != 2:
            raise HandlerError(400, "grant: a range is [offset, length]")
        offset, length = pair
        if offset < 0 or length <= 0 or offset + length > size:
            raise HandlerError(400, f"grant: {offset}+{length} is outside this segment")
        out.append((offset, length))
    return out


def expire(engine: Any) -> None:
    """Drop grants past their ttl (already refused; this frees their table entries)."""
    if engine is not None:
        engine.revoke_expired()


class GrantBook:
    """The grants this store handed out and the master epoch each was asked under.

    After a failover the new leader may re-use a range that the deposed one had granted
    for a put still in flight: a late writer would overwrite the new object (readers see
    a MAC mismatch: a miss, never wrong KV, but a lost object). So when the store follows
    a higher epoch it revokes every grant of the lower ones at once (`revoke_below`),
    instead of letting them run to their ttl (up to the put timeout)."""

    def __init__(self) -> None:
        self._issued: dict[int, tuple[int, float]] = {}  # region id -> (epoch, expiry)

    def __len__(self) -> int:
        return len(self._issued)

    def add(self, reply: PoolGrantReply, segment: RegionDescriptor, epoch: int, ttl: float) -> None:
        """Note a grant just made (not the segment's own descriptor, which rdma and a full
        shm table hand out); forget those past their ttl."""
        now = time.monotonic()
        self._issued = {r: e for r, e in self._issued.items() if e[1] > now}
        region_id = reply.descriptor.get("region_id") if reply.descriptor else None
        if region_id is not None and region_id != segment.region_id:
            self._issued[region_id] = (epoch, now + ttl)

    def forget(self, region_ids: list[int]) -> None:
        for region_id in region_ids:
            self._issued.pop(region_id, None)

    def revoke_below(self, engine: TransferEngine, epoch: int) -> int:
        """Revoke every grant asked under an epoch below `epoch`; how many."""
        stale = [r for r, (e, _) in self._issued.items() if e < epoch]
        for region_id in stale:
            with contextlib.suppress(RegionBusy):  # unregistered all the same (errors.py)
                engine.revoke(region_id)
            del self._issued[region_id]
        return len(stale)
