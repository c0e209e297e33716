"""What capabilities add to pool calls: the master -> store grant round trip.

A get now waits, in the master, for one PoolGrant round trip to each store it names (in
parallel); a put_start for one too, and its put_end for the revocation (docs/pool.md,
"Capabilities"). This row times that round trip alone, against a store of the run, the
way the master asks: each request grants reads of one 4 KiB range and revokes the grant
of the request before. Next to the `bus echo` floor it shows what the store's handler
(a grant: a region-table entry) adds to a bare round trip.
"""

from __future__ import annotations

from typing import Any

from bench.pool_common import row, timed
from libs.common.bus.connection import Bus
from libs.common.messages.pool import PoolGrant, PoolGrantReply
from libs.common.pool.client import PoolClient


async def grant_rows(client: PoolClient, bus: Bus, store: str, args: Any) -> list[dict[str, Any]]:
    epoch = (await client.stats()).epoch  # stores follow the master's epoch
    subject = f"tandem.pool.store.{store}.grant"
    last: list[int] = []

    async def once(_i: int) -> None:
        req = PoolGrant(epoch, "read", [[0, 4096]], 10.0, revoke=last[-1:])
        reply = await bus.request(subject, req, PoolGrantReply)
        last[:] = [int(reply.descriptor["region_id"])]

    lat = await timed(once, args.seconds, args.max_iters)
    await bus.request(subject, PoolGrant(epoch, revoke=last), PoolGrantReply)
    return [row("floor", "store grant", "-", 0, 1, lat)]
