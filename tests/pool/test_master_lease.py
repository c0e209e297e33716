"""The pool master leader's lease across JetStream outages (issue 39).

Real nats-server with JetStream, two master processes (`master`, `master-b`) and a store.
The outage is the nats-server itself: paused (SIGSTOP, then SIGCONT: every request to the
bucket times out, as under a stalled JetStream) or restarted on the same port with the
same store directory. Shorter than the lease: the same leader with the same epoch, and the
pool serves what it held. Longer: the old leader steps down when its lease runs out, one
master leads afterwards with a higher epoch, and the masters' own logs show that the two
were never leaders at the same instant (each leadership from its "elected" line to its
step-down line, on this host's clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import time
from datetime import datetime

from libs.common.bus.connection import BusError
from libs.common.messages.control import InfoRequest
from libs.common.messages.pool import PoolStats
from scripts.nats_server import NatsServer
from tests.pool.conftest import master_and_client, master_role

MASTERS = ("master", "master-b")
KEYS = [f"lease-{i}" for i in range(16)]
BEGIN = ("elected pool master leader", "leader lease renewed after it lapsed; serving again")
STEP_DOWN = (
    "leader lease expired unrenewed (JetStream unreachable); not serving until it is renewed",
    "another master holds the leadership; stepping down",
    "a master with a higher epoch exists; this one stops serving (restart it to take over)",
    "leadership released",
)


@contextlib.asynccontextmanager
async def _pool(pool_procs, nats_url, lease: str):
    """Both masters with `lease`, one store, KEYS put; yields (pool, leader, epoch)."""
    args = ("--election-lease", lease)
    async with master_and_client(pool_procs, nats_url, *args) as pool:
        pool.procs.start("cache_master", "master-b", "--heartbeat-timeout", "3", *args)
        pool.procs.store("store-a")
        await pool.wait_stores(1)
        roles = await _roles(pool.bus, both_up=True)
        assert sorted(roles.values()) == ["leader", "standby"], roles
        for i in range(len(KEYS)):
            pool.fill(i * 4096, os.urandom(4096))
        put = await pool.client.batch_put(KEYS, pool.mem, [i * 4096 for i in range(len(KEYS))],
                                          [4096] * len(KEYS))  # fmt: skip
        assert all(r.ok for r in put)
        leader = next(sid for sid, role in roles.items() if role == "leader")
        yield pool, leader, (await pool.client.stats()).epoch


async def _roles(bus, both_up: bool = False, settle: float = 20.0) -> dict[str, str]:
    """Each master's role once one leads and every other stands by, is fenced or is down
    (`both_up`: stands by); bounded in time."""
    deadline = time.monotonic() + settle
    while True:
        roles = {sid: await master_role(bus, sid) for sid in MASTERS}
        if both_up:
            done = sorted(roles.values()) == ["leader", "standby"]
        else:
            done = list(roles.values()).count("leader") == 1
        if done or time.monotonic() > deadline:
            return roles
        await asyncio.sleep(0.1)


async def _stats(pool, stores: int, timeout: float = 20.0) -> PoolStats:
    """The pool's stats once `stores` stores are mounted and every key is known."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            stats = await pool.bus.request("tandem.pool.master.stats", InfoRequest(), PoolStats,
                                           timeout=1, responder_wait=0.1)  # fmt: skip
            if len(stats.stores) == stores and stats.objects >= len(KEYS):
                return stats
        except BusError:
            pass
        assert time.monotonic() < deadline, f"the pool did not serve again within {timeout}s"
        await asyncio.sleep(0.1)


async def _reads_back(pool) -> None:
    offsets = [pool.half + i * 4096 for i in range(len(KEYS))]
    got = await pool.client.batch_get(KEYS, pool.mem, offsets, 4096)
    assert [r.error for r in got if not r.ok] == []
    for i in range(len(KEYS)):
        assert pool.read(pool.half + i * 4096, 4096) == pool.read(i * 4096, 4096)


def _leaderships(pool_procs, sid: str) -> list[tuple[float, float]]:
    """[(elected, stepped down)] of master `sid`, unix seconds from its JSON log lines;
    a leadership still held ends at +inf."""
    spans: list[tuple[float, float]] = []
    began = None
    for line in pool_procs.log(sid).splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        at = datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp()
        if entry.get("event") in BEGIN and began is None:
            began = at
        elif entry.get("event") in STEP_DOWN and began is not None:
            spans.append((began, at))
            began = None
    if began is not None:
        spans.append((began, float("inf")))
    return spans


def _never_two_leaders(pool_procs) -> list[tuple[str, float, float]]:
    spans = sorted((b, e, sid) for sid in MASTERS for b, e in _leaderships(pool_procs, sid))
    for (_, end, sid), (begin, _, other) in itertools.pairwise(spans):
        assert end <= begin, f"{sid} led until {end}, {other} from {begin}: two leaders"
    return [(sid, b, e) for b, e, sid in spans]


@contextlib.contextmanager
def _paused(server: NatsServer):
    """SIGSTOP the nats-server this test started (by its pid), SIGCONT on the way out."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


async def test_a_jetstream_pause_shorter_than_the_lease_keeps_the_leader_and_its_epoch(
    pool_procs, nats_server, nats_url
):
    """The default lease (2.5 s), JetStream paused 1.5 s (the leader can ride out about
    2.2 s: a renewal interval and a retry less than the lease; less on a busy host)."""
    async with _pool(pool_procs, nats_url, "2.5") as (pool, leader, epoch):
        with _paused(nats_server):
            await asyncio.sleep(1.5)
        await asyncio.sleep(2.5)  # a lease after it: a standby that would claim has
        assert await _roles(pool.bus) == {sid: "leader" if sid == leader else "standby"
                                          for sid in MASTERS}  # fmt: skip
        assert (await _stats(pool, 1)).epoch == epoch
        await _reads_back(pool)
        assert [s[0] for s in _never_two_leaders(pool_procs)] == [leader]


async def test_a_nats_restart_keeps_the_leader_and_its_epoch(pool_procs, nats_server, nats_url):
    """nats-server stopped and started again on its port and store directory (the restart
    and the clients' reconnect take 1-2 s on this busy host: a lease of 5 s)."""
    async with _pool(pool_procs, nats_url, "5") as (pool, leader, epoch):
        port, workdir = nats_server.port, nats_server.workdir
        stopped = time.monotonic()
        nats_server.stop()
        again = NatsServer(workdir, port=port).start()
        try:
            restart = time.monotonic() - stopped
            stats = await _stats(pool, 1)
            print(f"\nnats restart: down {restart:.2f}s; the pool served again "
                  f"{time.monotonic() - stopped:.2f}s after the stop")  # fmt: skip
            assert stats.epoch == epoch
            await asyncio.sleep(5.0)  # a lease after it
            assert (await _roles(pool.bus))[leader] == "leader"
            assert (await _stats(pool, 1)).epoch == epoch
            await _reads_back(pool)
            assert [s[0] for s in _never_two_leaders(pool_procs)] == [leader]
        finally:
            pool_procs.stop_all()  # before their nats-server goes
            again.stop()


async def test_jetstream_gone_for_most_of_the_lease_keeps_the_leader_and_the_pool_serving(
    pool_procs, nats_server, nats_url
):
    """nats-server restarted without JetStream for 3 s, then with it again (same port and
    store directory): core NATS serves all along, so the pool must too, while every call
    to the bucket fails at once ("no responders"). A lease of 6 s: the outage, with the two
    reconnects, lasts about 4 s. The old leader retried every lease / 3 and lost the key
    to a standby reading every lease / 10."""
    async with _pool(pool_procs, nats_url, "6") as (pool, leader, epoch):
        port, workdir = nats_server.port, nats_server.workdir
        nats_server.stop()
        bare = NatsServer(workdir / "bare", port=port, jetstream=False).start()
        try:
            began = time.monotonic()
            stats = await _stats(pool, 1)  # core NATS: the leader serves without JetStream
            assert stats.epoch == epoch
            await _reads_back(pool)
            await asyncio.sleep(max(0.0, 3.0 - (time.monotonic() - began)))
        finally:
            bare.stop()
        again = NatsServer(workdir, port=port).start()
        try:
            gone = time.monotonic() - began
            await asyncio.sleep(6.0)  # a lease after it
            assert await _roles(pool.bus) == {sid: "leader" if sid == leader else "standby"
                                              for sid in MASTERS}  # fmt: skip
            assert (await _stats(pool, 1)).epoch == epoch
            await _reads_back(pool)
            assert [s[0] for s in _never_two_leaders(pool_procs)] == [leader]
            print(f"\nJetStream gone {gone:.2f}s (lease 6s): same leader, same epoch")
        finally:
            pool_procs.stop_all()
            again.stop()


async def test_a_jetstream_pause_longer_than_the_lease_hands_over_without_two_leaders(
    pool_procs, nats_server, nats_url
):
    """Paused for two leases: the leader stops serving at its lease's end; one master
    leads afterwards (the old one if its renewal at its own revision lands first: the
    same epoch; else the standby, with a higher epoch, and the old one exits, for its
    supervisor to start again as a standby), never two at once, and the stores mount
    on it."""
    async with _pool(pool_procs, nats_url, "1.5") as (pool, leader, epoch):
        with _paused(nats_server):
            await asyncio.sleep(3.0)
        roles = await _roles(pool.bus)
        assert list(roles.values()).count("leader") == 1, roles
        stats = await _stats(pool, 1)
        spans = _never_two_leaders(pool_procs)
        assert spans[0][0] == leader and spans[0][2] < float("inf"), spans
        assert len(spans) == 2 and spans[1][2] == float("inf"), spans
        if spans[1][0] == leader:  # it renewed its own claim: nobody claimed meanwhile
            assert stats.epoch == epoch
        else:
            assert stats.epoch > epoch
        print(f"\nlease 1.5s, JetStream paused 3s: {spans[0][0]} stopped serving, "
              f"{spans[1][0]} led {spans[1][1] - spans[0][2]:.2f}s later")  # fmt: skip
        await _reads_back(pool)
