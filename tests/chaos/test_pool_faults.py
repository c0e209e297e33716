"""kill -9 in the KV pool (a store; the master): the pool is a cache, so clients see only
exact completions, and what the stores still hold is readable again once the master is back.
"""

import asyncio
import time

import pytest

from libs.common.engine.core.kv_hash import PageHasher
from libs.common.messages.control import InfoRequest
from libs.common.messages.pool import PoolStats
from libs.common.pool.client import LocalMemory, PoolClient
from libs.common.transfer import create_engine
from tests.chaos.cases import CASES
from tests.chaos.client import complete
from tests.chaos.load import Load
from tests.chaos.reports import PoolWatch, info
from tests.workers.conftest import generate

pytestmark = pytest.mark.slow


async def _page_keys(bus, ids: list[int]) -> list[str]:
    details = await info(bus, "prefill", "p1")
    return PageHasher(details["model_id"], details["kv_dtype"], details["page_size"]).keys(ids)


async def test_store_kill_reads_fall_back_to_the_other_replica_exactly(chaos, bus, http):
    (prompt, other), want = CASES["store_kill"].prompts, chaos.want["store_kill"]
    keys = (await _page_keys(bus, prompt))[: (len(prompt) - 1) // 16]
    watch = await PoolWatch(bus).start()
    killed = False
    try:
        first = await generate(bus, "chaos-store-1", prompt, decode="d1", prefill="p1",
                               max_tokens=8, timeout=60)  # fmt: skip
        assert first.error is None and first.text == want[0]
        await watch.wait_for(keys, stores=("s1", "s2"), timeout=30)  # both replicas written
        chaos.kill("s1")
        killed = True
        # p2 never saw the prompt: it reads every page from the pool; s1 is still listed
        # by the master (until its heartbeats are missed), so reads meet a dead store first
        again, fresh = await asyncio.gather(
            generate(bus, "chaos-store-2", prompt, decode="d2", prefill="p2", max_tokens=8,
                     timeout=60),
            complete(http, chaos.url, other, 8, False),
        )  # fmt: skip
        assert again.error is None and again.text == want[0]
        assert again.usage.cached_tokens.get("pool", 0) == len(keys) * 16  # from s2
        assert fresh.ok and fresh.text == want[1], fresh
        print(f"\nstore kill: {len(keys)} pages read from the surviving replica, exact")
    finally:
        await watch.stop()
        if killed:
            chaos.restart("s1")  # the next test waits for it to mount


async def _wait_master(bus, stores: int, objects: int, timeout: float) -> PoolStats:
    async with asyncio.timeout(timeout):
        while True:
            try:
                stats = await bus.request("tandem.pool.master.stats", InfoRequest(), PoolStats,
                                          timeout=1)  # fmt: skip
                if len(stats.stores) == stores and stats.objects >= objects:
                    return stats
            except Exception:
                pass  # not up yet
            await asyncio.sleep(0.2)


async def _read_all(bus, keys: list[str]) -> list[str]:
    """Read every key from the pool (checksums verified by the client); return the errors."""
    engine = create_engine("tcp", host="127.0.0.1")
    await engine.start()
    try:
        per, room = 8, 1 << 20
        mem = LocalMemory.register(engine, engine.allocate(per * room))
        client = PoolClient(bus, engine, timeout=10)
        errors = []
        for i in range(0, len(keys), per):
            batch = keys[i : i + per]
            got = await client.batch_get(batch, mem, [j * room for j in range(len(batch))], room)
            errors += [f"{r.key}: {r.error}" for r in got if not r.ok]
        return errors
    finally:
        await engine.stop()


async def test_master_kill_under_load_serves_on_and_every_held_object_reads_after_restart(
    chaos, bus, http
):
    case, want = CASES["master_kill"], chaos.want["master_kill"]
    watch = await PoolWatch(bus).start()
    load = Load(http, chaos.url, case, want, concurrency=2)
    killed = False
    try:
        await load.start()
        await load.wait_rounds(1, timeout=90)  # every prompt served once: the pool holds them
        await asyncio.sleep(1.0)  # the last write-throughs land
        chaos.kill("m1")
        killed = True
        await bus.nc.flush()  # every event the master published before it died is here
        held = sorted(watch.keys())
        assert held, "the pool held nothing before the kill"
        served, killed_at = load.completed, time.monotonic()
        await asyncio.sleep(6.0)  # no master: pool misses; requests go on
        chaos.restart("m1")
        restarted = time.monotonic()
        during = sum(s.outcome.ok and killed_at < s.ended < restarted for s in load.sent)
        await _wait_master(bus, stores=2, objects=len(held), timeout=30)
        # The count can be reached by objects written since the restart while a store's
        # report of the older ones is still on its way: read until every held one is back.
        deadline = restarted + 30
        for _ in range(120):
            missing = await _read_all(bus, held)
            if not missing or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        recovered_s = time.monotonic() - restarted
        assert missing == [], missing[:4]
        await load.wait_completed(load.completed + 4, timeout=60)  # and on after it
        await load.stop()
    finally:
        await watch.stop()
        await load.stop()
        if killed and chaos.local.procs["m1"].poll() is not None:
            chaos.restart("m1")
    assert load.completed >= served + 4 and during >= 1, (served, during)
    assert load.wrong() == [] and load.failed() == [], (load.wrong(), load.failed())
    assert recovered_s < 20
    slowest = max(s.outcome.seconds for s in load.sent)
    print(
        f"\nmaster kill: {len(held)} objects held, all read back {recovered_s:.1f}s after "
        f"the restart; {len(load.sent)} requests, {during} completed without a master, "
        f"slowest {slowest:.1f}s, failed 0, wrong 0"
    )
