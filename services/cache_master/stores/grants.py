"""Capabilities for clients: the master asks each store named in a put_start or get reply
for a grant on just those ranges (PoolGrant), and hands the grants out instead of the
stores' segment descriptors (docs/pool.md, "Capabilities").

    put_start -> a write grant per store on the allocated ranges, ttl = the put timeout;
                 revoked (awaited) at the put's first put_end or put_revoke
    get       -> a read grant per store on the found replicas' ranges, ttl = the lease

A store that does not answer within `timeout_s` gets no grant: a get leaves its replicas
out, a put_start fails (503) and frees what it reserved. The master serves each endpoint
in order, so a slow store delays the requests queued behind; its heartbeats will soon
drop it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from libs.common.bus.connection import Bus, BusError
from libs.common.log import get_logger
from libs.common.messages.pool import PoolGrant, PoolGrantReply

log = get_logger(__name__)


class StoreGrants:
    """Asks stores for grants; remembers each put's until it ends."""

    def __init__(self, bus: Bus, subject: Callable[[str], str], timeout_s: float = 2.0):
        self._bus = bus
        self._subject = subject  # store id -> its grant subject
        self._timeout_s = timeout_s
        self._puts: dict[str, tuple[float, dict[str, int]]] = {}  # put id -> (until, grants)

    async def issue(
        self, epoch: int, ranges: dict[str, list[list[int]]], mode: str, ttl: float
    ) -> dict[str, dict[str, Any]]:
        """store id -> a grant's descriptor, for the stores that granted."""
        stores = list(ranges)
        asks = [self._ask(sid, PoolGrant(epoch, mode, ranges[sid], ttl)) for sid in stores]
        replies = await asyncio.gather(*asks)
        return {sid: r.descriptor for sid, r in zip(stores, replies, strict=True) if r}

    def remember(self, put_id: str, granted: dict[str, dict[str, Any]], ttl: float) -> None:
        self.forget_expired()
        ids = {sid: int(d.get("region_id", 0)) for sid, d in granted.items()}
        self._puts[put_id] = (time.monotonic() + ttl, ids)

    async def end_put(self, epoch: int, put_id: str) -> None:
        """Revoke a put's grants (its first put_end or put_revoke); waits for the stores,
        so no write of that put lands after the reply."""
        _, ids = self._puts.pop(put_id, (0.0, {}))
        await asyncio.gather(*(self._ask(sid, PoolGrant(epoch, revoke=[rid]))
                               for sid, rid in ids.items()))  # fmt: skip

    def forget_expired(self) -> None:
        now = time.monotonic()
        for put_id in [p for p, (until, _) in self._puts.items() if until <= now]:
            del self._puts[put_id]  # the stores expire those grants themselves

    async def _ask(self, store_id: str, req: PoolGrant) -> PoolGrantReply | None:
        try:
            return await self._bus.request(self._subject(store_id), req, PoolGrantReply,
                                           timeout=self._timeout_s, responder_wait=0)  # fmt: skip
        except BusError as e:
            log.warning("store grant failed", store=store_id, mode=req.mode or "revoke",
                        error=str(e))  # fmt: skip
            return None


def by_store(pairs: list[tuple[Any, int]]) -> dict[str, list[list[int]]]:
    """(replica, size) pairs -> store id -> [[offset, size], ...]."""
    out: dict[str, list[list[int]]] = {}
    for replica, size in pairs:
        out.setdefault(replica.store_id, []).append([replica.offset, size])
    return out
