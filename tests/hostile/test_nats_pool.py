"""Forged pool and router control messages against the real cluster: each request gets the
error code that names its fault, each published message is dropped, and the state the
forger aimed at is untouched (the master's epoch, the store's mount, the mounts in
progress, other routers' requests).

The fuzzing of tests/hostile/test_nats_hostile.py (malformed bytes, ~1 MiB bodies, each
field of a good message set to a wrong type or an extreme value) runs here on the subjects
whose good message depends on the cluster's state: the store's `replicate` (the store's
epoch), the masters' `epoch` announcements (one below the master's) and the routers'
heartbeats (while a real stream runs). Any bus client may send these (docs/security.md):
what is asserted is that a forger can do no more than the protocol lets anyone do.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from libs.common.bus.connection import settle
from libs.common.messages.control import InfoRequest, RouterHeartbeat, ServiceInfo
from libs.common.messages.mounts import (
    PoolMount,
    PoolMountChunk,
    PoolMountEnd,
    PoolMountPage,
    PoolMountReply,
)
from libs.common.messages.pool import (
    PoolCopy,
    PoolKeys,
    PoolMasterEpoch,
    PoolReplicate,
    PoolStats,
    epoch_ceiling,
)
from tests.hostile.conftest import Hostile
from tests.hostile.test_nats_hostile import KEY, _check_alive, fuzz_publish, fuzz_request

pytestmark = pytest.mark.slow

MASTER = "tandem.pool.master"
HOUR_NS = 3600 * 10**9
# A well-formed descriptor of a segment nobody serves (port 1 refuses at once).
NOWHERE = {"v": 1, "transport": "tcp", "endpoint": "127.0.0.1:1", "region_id": 7,
           "length": 1 << 20, "token": "ab" * 16}  # fmt: skip


def _implausible() -> int:
    """An epoch an hour past what the clock allows (the ceiling moves with the clock:
    `ceiling + 1` is plausible a millisecond later, and a plausible higher epoch fences
    the master for good, by design: docs/pool.md)."""
    return epoch_ceiling(time.time_ns() + HOUR_NS)


async def _ask(nc, subject: str, message) -> tuple[int | None, bytes]:
    """(error code or None, reply body)."""
    reply = await nc.request(subject, message.encode(), timeout=20)
    code = (reply.headers or {}).get("Nats-Service-Error-Code")
    return (int(code) if code is not None else None), reply.data


async def _info(nc, subject: str) -> dict:
    reply = await nc.request(subject, InfoRequest().encode(), timeout=10)
    return ServiceInfo.decode(reply.data).details


async def _stats(nc) -> PoolStats:
    return PoolStats.decode((await nc.request(f"{MASTER}.stats", b"", timeout=10)).data)


async def _pool_state(nc) -> tuple:
    """What a forger must not change: the master's epoch and fence, the stores it knows
    with their object counts, the store's mount, epoch and objects."""
    stats, master = await _stats(nc), await _info(nc, "tandem.cache_master.m1.info")
    store = await _info(nc, "tandem.cache_store.s1.info")
    assert store["mounted"] and master["fenced_by"] == 0 and "s1" in stats.stores
    return (stats.epoch, master["fenced_by"], sorted(stats.stores), stats.objects,
            store["mounted"], store["epoch"], store["objects"])  # fmt: skip


async def _begin(nc, store_id: str) -> str:
    code, data = await _ask(nc, f"{MASTER}.mount", PoolMount(store_id, NOWHERE))
    assert code is None, data
    return PoolMountReply.decode(data).mount_id


async def test_wrong_mount_steps_get_their_code_and_mount_nothing(hostile: Hostile, nc):
    before = await _pool_state(nc)
    epoch = before[0]
    # a chunk out of order (1 expected) ends the session: its end is then unknown
    mount_id = await _begin(nc, "evil-order")
    code, _ = await _ask(nc, f"{MASTER}.mount_chunk", PoolMountChunk("evil-order", mount_id, 2))
    assert code == 409
    code, _ = await _ask(nc, f"{MASTER}.mount_end", PoolMountEnd("evil-order", mount_id, 1, 0))
    assert code == 404
    # an end whose counts do not match what was sent
    mount_id = await _begin(nc, "evil-count")
    code, _ = await _ask(nc, f"{MASTER}.mount_end", PoolMountEnd("evil-count", mount_id, 1, 5))
    assert code == 409
    # a page before the end; a page of another store's mount id; the real store, forged id
    mount_id = await _begin(nc, "evil-page")
    code, _ = await _ask(nc, f"{MASTER}.mount_page", PoolMountPage("evil-page", mount_id, 0))
    assert code == 404
    for store, mid in (("evil-other", mount_id), ("s1", mount_id), ("s1", "0" * 16)):
        code, _ = await _ask(nc, f"{MASTER}.mount_chunk", PoolMountChunk(store, mid, 1))
        assert code == 404, store
    # a stale epoch changes nothing; one past what the clock allows is refused
    stale = PoolMountChunk("s1", "0" * 16, 1, epoch=epoch - 1)
    assert (await _ask(nc, f"{MASTER}.mount_chunk", stale))[0] == 404
    future = PoolMountEnd("s1", "0" * 16, 1, 0, epoch=_implausible())
    assert (await _ask(nc, f"{MASTER}.mount_end", future))[0] == 400
    # a chunk past the master's record limit in a session that exists
    mount_id = await _begin(nc, "evil-big")
    big = PoolMountChunk("evil-big", mount_id, 1, records=[])
    raw = big.encode().replace(b'"records":[]', b'"records":' + _records(8193))
    reply = await nc.request(f"{MASTER}.mount_chunk", raw, timeout=20)
    assert reply.headers["Nats-Service-Error-Code"] == "413"
    after = await _pool_state(nc)
    assert after == before and not any(s.startswith("evil") for s in after[2])
    await _check_alive(hostile, nc)


def _records(n: int) -> bytes:
    one = {"key": "k", "offset": 0, "size": 64, "checksum": "0" * 16}
    return json.dumps([one] * n, separators=(",", ":")).encode()


async def test_forged_copy_orders_copy_nothing_and_the_store_stays_mounted(hostile: Hostile, nc):
    before = await _pool_state(nc)
    epoch = before[5]  # the store's: a copy order of any other epoch is refused (409)
    subject = "tandem.pool.store.s1.replicate"
    size = (await _info(nc, "tandem.cache_store.s1.info"))["segment_size"]
    copy = PoolCopy(KEY, 64, "0" * 16, offset=0, source="evil", source_offset=0)
    good = PoolReplicate(epoch, [copy], {"evil": NOWHERE})  # unreachable: nothing copied
    await fuzz_request(nc, subject, good)
    code, data = await _ask(nc, subject, good)
    assert code is None and PoolKeys.decode(data).keys == []
    for stale in (epoch - 1, 0, epoch + 1):
        assert (await _ask(nc, subject, PoolReplicate(stale, [copy], {"evil": NOWHERE})))[0] == 409
    outside = [PoolCopy(KEY, 64, "0" * 16, size - 63, "evil", 0),
               PoolCopy(KEY, 0, "0" * 16, 0, "evil", 0),
               PoolCopy(KEY, 64, "0" * 16, -1, "evil", 0)]  # fmt: skip
    for bad in outside:
        code, _ = await _ask(nc, subject, PoolReplicate(epoch, [bad], {"evil": NOWHERE}))
        assert code == 400, bad
    unusable = {"evil": {"v": 1, "transport": "tcp"}}  # a descriptor that does not parse
    code, data = await _ask(nc, subject, PoolReplicate(epoch, [copy], unusable))
    assert code is None and PoolKeys.decode(data).keys == []
    assert await _pool_state(nc) == before
    await _check_alive(hostile, nc)


async def test_a_forged_lower_epoch_leaves_the_masters_epoch(hostile: Hostile, nc):
    before = await _pool_state(nc)
    epoch = before[0]
    subject = f"{MASTER}.epoch"
    await fuzz_publish(nc, subject, PoolMasterEpoch(epoch - 1, master_id="evil"))
    for forged in (PoolMasterEpoch(_implausible(), "zzz"), PoolMasterEpoch(epoch, "")):
        await nc.publish(subject, forged.encode())  # ignored; a tie goes to the larger id
    await nc.flush()
    await asyncio.sleep(0.5)
    assert await _pool_state(nc) == before
    await _check_alive(hostile, nc)


async def test_forged_router_heartbeats_cancel_no_ones_stream(hostile: Hostile, nc):
    """Malformed beats, beats of other ids, and, right after each of the real router's
    beats, one under its id with the shortest timeout, while it streams a request: the
    stream ends whole (a forged timeout must not bring the workers' cancel forward)."""
    instance = (await _info(nc, "tandem.router.router-h.info"))["instance"]
    subject = f"tandem.routers.{instance}.heartbeat"
    short = RouterHeartbeat(router=instance, service_id="router-h", interval=0.1, timeout=0.0,
                            timestamp=time.time()).encode()  # fmt: skip
    echoed = 0

    async def echo(msg) -> None:  # the real beat, then at once the forged one
        nonlocal echoed
        if msg.data != short:
            await nc.publish(subject, short)
            echoed += 1

    started = asyncio.Event()
    stream = asyncio.create_task(_stream(hostile, 256, started))
    await asyncio.wait_for(started.wait(), 120)  # the workers hold the request
    sub = await nc.subscribe(subject, cb=echo)
    await settle(nc)  # the router beats on its own connection
    try:
        beat = RouterHeartbeat(router="evil", service_id="evil", interval=0.1, timeout=0.5,
                               timestamp=time.time())  # fmt: skip
        await fuzz_publish(nc, "tandem.routers.evil.heartbeat", beat)
        running = not stream.done()
        tokens, finish = await asyncio.wait_for(stream, 300)
    finally:
        await sub.unsubscribe()
    print(f"stream of {tokens} tokens; {echoed} forged beats under its router's id")
    assert running and echoed >= 2, (running, echoed)  # they overlapped the stream
    assert (tokens, finish) == (256, "length")
    await _check_alive(hostile, nc)


async def _stream(hostile: Hostile, max_tokens: int, started: asyncio.Event) -> tuple[int, str]:
    """A streamed greedy completion: (completion tokens in its usage, finish reason);
    `started` is set at its first event."""
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    tokens, finish = 0, ""
    async with aiohttp.ClientSession(headers=hostile.headers) as http:
        async with http.post(f"{hostile.url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                started.set()
                for choice in event.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
    return tokens, finish
