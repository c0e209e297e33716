"""The master's bounds over NATS: each refusal is a clear error reply, and the master
keeps serving everyone else."""

import asyncio
import contextlib
import os
import time

import pytest

from libs.common.bus.connection import RemoteError
from libs.common.messages.pool import (
    PoolCount,
    PoolNewObject,
    PoolPutFinish,
    PoolPutStart,
    PoolPutStartReply,
)
from tests.pool.conftest import master_and_client

CK = "0123456789abcdef"


@contextlib.asynccontextmanager
async def _pool(pool_procs, nats_url, *master_args):
    """A master with `master_args`, one store, and a client."""
    async with master_and_client(pool_procs, nats_url, *master_args, name="limits-client") as pool:
        pool_procs.store("store-a")
        await pool.wait_stores(1)
        yield pool


async def _still_serves(pool) -> None:
    pool.fill(0, os.urandom(4096))
    key = f"alive-{os.urandom(4).hex()}"
    assert (await pool.client.batch_put([key], pool.mem, [0], [4096]))[0].ok


async def test_a_put_below_the_minimum_object_size_is_refused_with_400(pool):
    pool.procs.store("store-a")
    await pool.wait_stores(1)
    pool.fill(0, os.urandom(64))
    with pytest.raises(RemoteError, match="minimum object size 64") as e:
        await pool.client.batch_put(["tiny"], pool.mem, [0], [63])
    assert e.value.code == 400
    assert (await pool.client.batch_put(["smallest"], pool.mem, [0], [64]))[0].ok
    await _still_serves(pool)


def _start(client: str, *keys: str) -> PoolPutStart:
    return PoolPutStart([PoolNewObject(k, 4096, CK) for k in keys], client=client)


async def test_a_client_over_its_pending_put_cap_gets_429_and_others_go_on(pool_procs, nats_url):
    async with _pool(pool_procs, nats_url, "--max-pending-puts", "8") as pool:
        ask = pool.bus.request
        subject = "tandem.pool.master.put_start"
        held = await ask(subject, _start("greedy", *[f"g{i}" for i in range(8)]), PoolPutStartReply)
        assert [s.status for s in held.slots] == ["ok"] * 8
        with pytest.raises(RemoteError, match="'greedy': 8 objects pending") as e:
            await ask(subject, _start("greedy", "g8"), PoolPutStartReply)
        assert e.value.code == 429
        other = await ask(subject, _start("polite", "p0"), PoolPutStartReply)
        assert other.slots[0].status == "ok"
        await _still_serves(pool)  # the harness's own client id
        # Revoking its reservations lets the greedy client put again.
        done = await ask("tandem.pool.master.put_revoke", PoolPutFinish(held.put_id, ["g0"]),
                         PoolCount)  # fmt: skip
        assert done.count == 1
        again = await ask(subject, _start("greedy", "g8"), PoolPutStartReply)
        assert again.slots[0].status == "ok"


async def test_a_lease_renewed_without_a_break_ends_at_max_lease_pin(pool_procs, nats_url):
    args = ("--lease-ttl", "1", "--max-lease-pin", "2")
    async with _pool(pool_procs, nats_url, *args) as pool:
        pool.fill(0, os.urandom(4096))
        assert (await pool.client.batch_put(["hot"], pool.mem, [0], [4096]))[0].ok
        errors, start = [], time.monotonic()
        while time.monotonic() - start < 4 and "pinned" not in errors:  # get every 0.2 s
            errors.append(
                (await pool.client.batch_get(["hot"], pool.mem, [pool.half], 4096))[0].error
            )
            await asyncio.sleep(0.2)
        assert errors[0] == "" and errors[-1] == "pinned", errors
        assert 0.8 <= time.monotonic() - start <= 2.5  # pinned once a lease would pass 2 s
        await asyncio.sleep(1.2)  # the last lease ends; the object may be evicted now
        got = await pool.client.batch_get(["hot"], pool.mem, [pool.half], 4096)
        assert got[0].ok and pool.read(pool.half, 4096) == pool.read(0, 4096)
        await _still_serves(pool)
