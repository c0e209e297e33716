"""Master epochs: a second master never allocates in a store that follows another.

A stale master (lower epoch) is fenced before it can take a store; a newer master
(higher epoch) takes the stores over and the old one stops serving.
"""

import asyncio
import os
import time

from libs.common.bus.connection import BusError
from libs.common.messages.control import InfoRequest
from libs.common.messages.pool import PoolNewObject, PoolPutStart, PoolPutStartReply, PoolStats
from services.cache_master.ha.epoch import outranks, pick_epoch


def test_a_later_epoch_from_the_clock_is_higher_and_a_configured_one_is_kept():
    now = time.time_ns()
    assert pick_epoch(0, now + 1_000_000) > pick_epoch(0, now)  # 1 ms later
    assert pick_epoch(7) == 7
    assert outranks(5, "a", 6, "a") and not outranks(6, "a", 5, "z")
    assert outranks(5, "a", 5, "b")  # a tie goes to the larger id


async def _wait_log(pool, sid: str, text: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in pool.procs.log(sid):
        assert time.monotonic() < deadline, f"{sid} never logged {text!r}"
        await asyncio.sleep(0.1)


async def _epochs_answering(pool, tries: int = 30) -> set[int]:
    """The epochs of the masters that answer stats (each request: one queue member)."""
    seen = set()
    for _ in range(tries):
        try:
            seen.add((await pool.bus.request("tandem.pool.master.stats", InfoRequest(),
                                             PoolStats, timeout=2)).epoch)  # fmt: skip
        except BusError:
            pass
    return seen


async def _put_start_epochs(pool, count: int) -> list[int]:
    """Epochs of the masters that reserved room for `count` new objects (one at a time)."""
    epochs = []
    for i in range(count):
        obj = PoolNewObject(f"ep-{os.urandom(6).hex()}-{i}", 4096, "0123456789abcdef")
        try:
            reply = await pool.bus.request("tandem.pool.master.put_start", PoolPutStart([obj]),
                                           PoolPutStartReply, timeout=2)  # fmt: skip
        except BusError:
            continue
        if reply.slots[0].status == "ok":
            epochs.append(reply.epoch)
    return epochs


async def test_a_stale_second_master_is_fenced_and_never_allocates(pool):
    pool.procs.store("store-a")
    await pool.wait_stores(1)
    first = (await pool.client.stats()).epoch
    pool.procs.start("cache_master", "master-b", "--epoch", "1")  # stale: below the first
    await _wait_log(pool, "master-b", "stops serving")
    assert await _epochs_answering(pool) == {first}
    epochs = await _put_start_epochs(pool, 30)
    assert epochs and set(epochs) == {first}
    assert "store mounted" not in pool.procs.log("master-b")
    assert pool.procs.procs["master-b"].poll() is None  # alive, serving nothing


async def test_a_newer_master_takes_the_store_and_fences_the_old_one(pool):
    pool.procs.store("store-a")
    await pool.wait_stores(1)
    pool.fill(0, os.urandom(4096))
    assert (await pool.client.batch_put(["before"], pool.mem, [0], [4096]))[0].ok
    first = (await pool.client.stats()).epoch
    # Without the election (it would stand by): a newer master imposed by hand.
    pool.procs.start("cache_master", "master-b", "--heartbeat-timeout", "3", "--election", "false")
    await _wait_log(pool, "master", "stops serving")
    await _wait_log(pool, "master-b", "store mounted")
    (second,) = await _epochs_answering(pool)
    assert second > first
    # The store follows the new master: the old object is known there, new puts land
    # there, and only the new master reserves room.
    await pool.wait_objects(1)
    got = await pool.client.batch_get(["before"], pool.mem, [pool.half], 4096)
    assert got[0].ok and pool.read(pool.half, 4096) == pool.read(0, 4096)
    epochs = await _put_start_epochs(pool, 30)
    assert epochs and set(epochs) == {second}


async def test_a_forged_epoch_from_the_future_is_refused_and_fences_nothing(pool, nats_url):
    import nats

    from libs.common.messages.pool import PoolMasterEpoch, PoolStoreRef, PoolStoreUpdate

    pool.procs.store("store-a")
    await pool.wait_stores(1)
    first = (await pool.client.stats()).epoch
    nc = await nats.connect(nats_url)
    try:
        forged = PoolStoreRef("store-a", epoch=2**63).encode()
        msg = await nc.request("tandem.pool.master.heartbeat", forged, timeout=5)
        assert msg.headers["Nats-Service-Error-Code"] == "400"
        await nc.publish("tandem.pool.master.epoch", PoolMasterEpoch(2**63, "liar").encode())
        await nc.publish("tandem.pool.store.store-a.update",
                         PoolStoreUpdate(seq=1, epoch=2**63).encode())  # fmt: skip
        await nc.flush()
    finally:
        await nc.close()
    await asyncio.sleep(1.0)  # a few heartbeats of the store
    assert await _epochs_answering(pool, 5) == {first}
    pool.fill(0, os.urandom(4096))
    assert (await pool.client.batch_put(["after-lies"], pool.mem, [0], [4096]))[0].ok
    assert "stops serving" not in pool.procs.log("master")
