"""Master failover (issue 26): masters elect one leader through JetStream KV
(services/cache_master/ha/election.py); a standby takes over a dead leader's stores, and an
old leader that lost its claim cannot allocate in them.

Real nats-server (JetStream), real master and store processes; the fencing test runs one
master in this process so it can call its handler after it was deposed.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from libs.common.bus.connection import BusError, HandlerError
from libs.common.messages.control import InfoRequest
from libs.common.messages.pool import PoolNewObject, PoolPutStart, PoolPutStartReply, PoolStats
from libs.common.transfer import RegionDescriptor, TransferError
from services.cache_master.config import CacheMasterConfig
from services.cache_master.ha.election import Claim
from services.cache_master.service import CacheMasterService
from tests.pool.conftest import master_and_client, master_role

LEASE = "2.5"  # the default, spelt out: the takeover bound below depends on it
TAKEOVER_LIMIT = 5.0  # issue 26: a standby serves within 5 s of the leader's death


async def _roles(bus, sids: tuple[str, ...], settle: float = 15.0) -> dict[str, str]:
    """Each master's role, once every one is leader or standby (bounded in time)."""
    deadline = time.monotonic() + settle
    while True:
        roles = {sid: await master_role(bus, sid) for sid in sids}
        if set(roles.values()) <= {"leader", "standby"} or time.monotonic() > deadline:
            return roles
        await asyncio.sleep(0.1)


async def _leader_first(bus) -> tuple[str, str]:
    """(leader, standby) of the two masters `master` and `master-b`."""
    first = await master_role(bus, "master") == "leader"
    return ("master", "master-b") if first else ("master-b", "master")


async def _stats_epochs(pool, tries: int = 20) -> set[int]:
    """Epochs of the masters that answer `stats` (a queue group: any member may answer)."""
    epochs = set()
    for _ in range(tries):
        epochs.add((await pool.client.stats()).epoch)
    return epochs


@pytest.fixture
async def two(pool_procs, nats_url):
    """Masters `master` and `master-b` (started one after the other) and a client."""
    async with master_and_client(pool_procs, nats_url, "--election-lease", LEASE) as pool:
        pool.procs.start("cache_master", "master-b", "--heartbeat-timeout", "3",
                         "--election-lease", LEASE)  # fmt: skip
        roles = await _roles(pool.bus, ("master", "master-b"))
        assert sorted(roles.values()) == ["leader", "standby"], roles
        yield pool


async def test_masters_started_at_once_elect_exactly_one_leader(pool_procs, nats_url):
    async with master_and_client(pool_procs, nats_url) as pool:  # `master`
        for sid in ("master-b", "master-c"):
            pool.procs.start("cache_master", sid, "--heartbeat-timeout", "3")
        sids = ("master", "master-b", "master-c")
        roles = await _roles(pool.bus, sids)
        assert sorted(roles.values()) == ["leader", "standby", "standby"], roles
        await asyncio.sleep(3.0)  # more than a lease: the standbys keep standing by
        assert await _roles(pool.bus, sids) == roles
        pool.procs.store("store-a")
        await pool.wait_stores(1)
        assert len(await _stats_epochs(pool)) == 1  # one master answers


async def test_a_standby_takes_over_a_killed_leader_within_5s_and_every_object_reads(two):
    pool = two
    for sid in ("store-a", "store-b"):
        pool.procs.store(sid)
    await pool.wait_stores(2)
    keys = [f"obj-{i}" for i in range(32)]
    for i, _ in enumerate(keys):
        pool.fill(i * 4096, os.urandom(4096))
    put = await pool.client.batch_put(keys, pool.mem, [i * 4096 for i in range(32)], [4096] * 32)
    assert all(r.ok for r in put)
    (old_epoch,) = await _stats_epochs(pool, 3)
    leader, standby = await _leader_first(pool.bus)
    await asyncio.sleep(1.0)  # the stores' indexes have the puts (an update per put_end)

    pool.procs.kill(leader)  # kill -9
    killed = time.monotonic()
    while True:  # until the new leader knows both stores and every object
        try:
            stats = await pool.bus.request("tandem.pool.master.stats", InfoRequest(), PoolStats,
                                           timeout=0.5, responder_wait=0.05)  # fmt: skip
            if len(stats.stores) == 2 and stats.objects >= len(keys):
                break
        except BusError:
            pass
        assert time.monotonic() - killed < 15, "no takeover within 15 s"
        await asyncio.sleep(0.05)
    takeover = time.monotonic() - killed
    print(f"\nmaster failover: takeover {takeover:.2f}s after kill -9 (lease {LEASE}s, store "
          f"heartbeat 0.3s), {len(keys)} objects on 2 stores")  # fmt: skip
    assert stats.epoch > old_epoch
    assert await master_role(pool.bus, standby) == "leader"
    got = await pool.client.batch_get(keys, pool.mem, [pool.half + i * 4096 for i in range(32)],
                                      4096)  # fmt: skip
    assert [r.error for r in got if not r.ok] == []
    for i in range(32):
        assert pool.read(pool.half + i * 4096, 4096) == pool.read(i * 4096, 4096)
    assert takeover < TAKEOVER_LIMIT


async def test_a_put_grant_of_a_killed_leader_ends_when_the_store_follows_the_new_one(two):
    """A put the deposed leader started must not write into a range the new leader may
    hand out again: the store revokes the old epoch's grants when it follows the new one
    (services/cache_store/grants.py, GrantBook), not at the grant's ttl (--put-timeout)."""
    pool = two
    pool.procs.store("store-a")
    await pool.wait_stores(1)
    new = PoolNewObject("late-writer", 4096, "0" * 16)
    started = await pool.bus.request("tandem.pool.master.put_start", PoolPutStart([new]),
                                     PoolPutStartReply)  # fmt: skip
    (replica,) = started.slots[0].replicas
    grant = RegionDescriptor.from_dict(started.segments[replica.store])
    await pool.engine.write(pool.mem.region, grant, [(0, replica.offset, 4096)])  # granted
    (old_epoch,) = await _stats_epochs(pool, 3)
    leader, _ = await _leader_first(pool.bus)
    pool.procs.kill(leader)  # kill -9: its put never ends
    deadline = time.monotonic() + 15
    while True:  # until the store has mounted at the new leader's epoch
        try:
            stats = await pool.bus.request("tandem.pool.master.stats", InfoRequest(), PoolStats,
                                           timeout=0.5, responder_wait=0.05)  # fmt: skip
            if stats.epoch > old_epoch and len(stats.stores) == 1:
                break
        except BusError:
            pass
        assert time.monotonic() < deadline, "no takeover within 15 s"
        await asyncio.sleep(0.05)
    with pytest.raises(TransferError, match="unknown region or wrong token"):
        await pool.engine.write(pool.mem.region, grant, [(0, replica.offset, 16)])


async def test_a_graceful_leader_stop_hands_over_at_once(two):
    pool = two
    pool.procs.store("store-a")
    await pool.wait_stores(1)
    leader, _ = await _leader_first(pool.bus)
    stopped = time.monotonic()
    assert pool.procs.stop(leader) == 0
    await pool.wait_stores(1, timeout=10)
    handover = time.monotonic() - stopped
    print(f"\nmaster handover on SIGTERM: serving again {handover:.2f}s after the signal")
    assert handover < 2.5  # well under a lease: the claim was released, not left to lapse


async def test_a_deposed_leader_is_fenced_and_the_store_refuses_its_allocation(
    pool_procs, nats_url
):
    """`old` (in this process) leads and the store mounts there; then it stops renewing its
    claim (cut off from JetStream, say) and the standby `master` takes over. The old one
    must step down, and an allocation it still attempts is refused by the store."""
    config = CacheMasterConfig.parse(["--nats-url", nats_url, "--service-id", "old",
                                      "--heartbeat-timeout", "3"])  # fmt: skip
    old = CacheMasterService(config)
    await old.start()
    try:
        for _ in range(100):  # the first master claims the empty key at once
            if old.role == "leader":
                break
            await asyncio.sleep(0.05)
        assert old.role == "leader"
        async with master_and_client(pool_procs, nats_url) as pool:  # `master`: standby
            assert (await _roles(pool.bus, ("master",)))["master"] == "standby"
            pool.procs.store("store-a")
            await pool.wait_stores(1)
            old_epoch = (await pool.client.stats()).epoch
            assert old_epoch == old.epoch

            old.election.abandon()  # its renewals stop: the claim lapses after the lease
            for _ in range(200):  # `master` wins and announces its epoch: `old` is fenced
                if old.role == "fenced":
                    break
                await asyncio.sleep(0.05)
            assert old.role == "fenced" and old.fence.fenced_by > old_epoch
            await pool.wait_stores(1)  # the store follows `master`
            new_epoch = (await pool.client.stats()).epoch
            assert new_epoch == old.fence.fenced_by
            put = PoolPutStart([PoolNewObject("fenced", 4096, "0" * 16)], replicas=1, client="t")
            with pytest.raises(HandlerError) as refused:
                await old._put_start(put)  # past its fence: the store refuses the grant
            assert refused.value.code == 503
            assert (await pool.client.stats()).epoch == new_epoch  # unchanged
    finally:
        await old.stop()


def test_a_claim_round_trips_and_garbage_reads_as_released():
    assert Claim.decode(Claim("m", 5).encode()) == Claim("m", 5)
    assert Claim.decode(b"not json") == Claim("", 0)
