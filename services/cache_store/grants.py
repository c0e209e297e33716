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

from typing import Any

from libs.common.bus.connection import HandlerError
from libs.common.log import get_logger
from libs.common.messages.pool import PoolGrant, PoolGrantReply
from libs.common.transfer import RegionDescriptor, TransferEngine

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
