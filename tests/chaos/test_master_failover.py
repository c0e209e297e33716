"""kill -9 of the pool's leader master with a standby running (issue 26): the standby
takes over within 5 s, clients see only exact completions, and every object the stores
held before the kill is readable from the new leader.

The chaos cluster runs one master (m1); this test adds a standby (m2) with the same flags
and, at its end, gives the leadership back to a restarted m1 (m2 stops gracefully and
releases its claim), so the other tests find the cluster as it was.
"""

import asyncio
import os
import signal
import time

import pytest

from tests.chaos.cases import CASES
from tests.chaos.harness import TOPOLOGY
from tests.chaos.load import Load
from tests.chaos.reports import PoolWatch
from tests.chaos.test_pool_faults import _read_all, _wait_master
from tests.pool.conftest import master_role

pytestmark = pytest.mark.slow

TAKEOVER_LIMIT = 5.0


async def _wait_role(bus, sid: str, role: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (now := await master_role(bus, sid)) != role:
        assert time.monotonic() < deadline, f"{sid} is {now}, not {role}, after {timeout}s"
        await asyncio.sleep(0.1)


async def _give_back_to_m1(chaos, bus) -> None:
    """m1 (restarted: a standby) leads again once m2 stops and releases its claim."""
    if chaos.local.procs["m1"].poll() is not None:
        chaos.restart("m1")
    await _wait_role(bus, "m1", "standby")
    m2 = chaos.local.procs.pop("m2")
    os.kill(m2.pid, signal.SIGTERM)
    m2.wait(timeout=20)
    await _wait_role(bus, "m1", "leader")


async def test_a_standby_master_takes_over_a_killed_leader_under_load_within_5s(chaos, bus, http):
    case, want = CASES["master_kill"], chaos.want["master_kill"]
    chaos.local.start_one("cache_master", "--service-id", "m2", *TOPOLOGY["m1"][1], label="m2")
    watch = await PoolWatch(bus).start()
    load = Load(http, chaos.url, case, want, concurrency=2)
    try:
        await _wait_role(bus, "m1", "leader")
        await _wait_role(bus, "m2", "standby")
        await load.start()
        await load.wait_rounds(1, timeout=90)  # every prompt served once: the pool holds them
        await asyncio.sleep(1.0)  # the last write-throughs land
        served = load.completed
        chaos.kill("m1")  # kill -9 of the leader
        killed_at = time.monotonic()
        await bus.nc.flush()  # every event the leader published before it died is here
        held = sorted(watch.keys())
        assert held, "the pool held nothing before the kill"
        await _wait_master(bus, stores=2, objects=len(held), timeout=30)
        takeover = time.monotonic() - killed_at
        assert await master_role(bus, "m2") == "leader"
        assert await _read_all(bus, held) == []
        await load.wait_completed(load.completed + 4, timeout=60)  # and on after it
        await load.stop()
    finally:
        await watch.stop()
        await load.stop()
        await _give_back_to_m1(chaos, bus)
    assert load.completed >= served + 4
    assert load.wrong() == [] and load.failed() == [], (load.wrong(), load.failed())
    slowest = max(s.outcome.seconds for s in load.sent)
    print(
        f"\nmaster failover: {len(held)} objects held, the standby served them all "
        f"{takeover:.2f}s after the leader's kill -9; {len(load.sent)} requests, slowest "
        f"{slowest:.1f}s, failed 0, wrong 0"
    )
    assert takeover < TAKEOVER_LIMIT
