"""Re-replication: when a store is declared dead, its objects are copied back up to
--replicas from a surviving replica, so losing another store loses nothing."""

import asyncio
import os
import time

from libs.common.bus.connection import Bus
from libs.common.messages.pool import PoolGetReply, PoolKeys
from libs.common.pool.client import PoolClient
from libs.common.transfer import create_engine
from tests.pool.conftest import PoolHarness

SIZE = 4096
COUNT = 1000


async def _replicas(pool, keys) -> list[set[str]]:
    reply = await pool.bus.request("tandem.pool.master.get", PoolKeys(keys), PoolGetReply)
    return [{r.store for r in o.replicas} for o in reply.objects]


async def _until(check, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not await check():
        assert time.monotonic() - start < timeout, what
        await asyncio.sleep(0.1)
    return time.monotonic() - start


async def test_a_dead_store_s_objects_are_copied_back_to_two_replicas(pool_procs, nats_url):
    pool_procs.master("--replicas", "2", "--heartbeat-timeout", "2")
    bus = Bus(nats_url, "repair-client", connect_timeout=10, request_timeout=5)
    engine = create_engine("tcp", host="127.0.0.1")
    await bus.connect()
    await engine.start()
    try:
        pool = PoolHarness(pool_procs, bus, engine, PoolClient(bus, engine, timeout=10))
        for sid in ("store-a", "store-b", "store-c"):
            pool_procs.store(sid)
        await pool.wait_stores(3)
        keys = [f"rr-{i}" for i in range(COUNT)]
        blobs = [os.urandom(SIZE) for _ in keys]
        for i, blob in enumerate(blobs):
            pool.fill(i * SIZE, blob)
        put = await pool.client.batch_put(keys, pool.mem, [i * SIZE for i in range(COUNT)],
                                          [SIZE] * COUNT)  # fmt: skip
        assert all(r.ok for r in put)
        before = await _replicas(pool, keys)
        assert all(len(s) == 2 for s in before)
        on_a = sum("store-a" in s for s in before)
        assert on_a > 0

        pool_procs.kill("store-a")
        killed = time.monotonic()
        await pool.wait_stores(2, timeout=15)
        declared = time.monotonic() - killed

        async def repaired() -> bool:
            return all(s == {"store-b", "store-c"} for s in await _replicas(pool, keys))

        took = await _until(repaired, 15, "objects not back to 2 replicas")
        stats = await pool.client.stats()
        assert stats.repaired >= on_a and stats.under_replicated == 0

        # Every object now survives the loss of one more store, with the right bytes.
        pool_procs.kill("store-b")
        dst = [pool.half + i * SIZE for i in range(COUNT)]
        got = await pool.client.batch_get(keys, pool.mem, dst, SIZE)
        assert all(r.ok for r in got), [r for r in got if not r.ok][:3]
        assert [pool.read(d, SIZE) for d in dst] == blobs
        print(f"{on_a} objects re-replicated {took:.2f}s after the store was declared dead "
              f"({declared:.2f}s after kill -9)")  # fmt: skip
    finally:
        await engine.stop()
        await bus.close()
