"""nats-server killed (-9) and started again on the same port, empty, under load: every
service reconnects by itself, the KV events stream exists again, and the system serves
again, exactly, without a restart of any service."""

import asyncio
import time

import aiohttp
import nats
import pytest

from libs.common.bus import discover
from libs.common.kv_events import STREAM_NAME
from tests.chaos.harness import CASES, TOPOLOGY, complete, prompt_ids
from tests.chaos.load import Load

pytestmark = pytest.mark.slow

SERVICES = {f"tandem-{service}" for service, _ in TOPOLOGY.values()}


async def _health(http: aiohttp.ClientSession, url: str) -> dict:
    try:
        async with http.get(f"{url}/health") as r:
            return {**(await r.json()), "http": r.status}
    except aiohttp.ClientError as e:
        return {"http": 0, "error": str(e)}


async def _until(http, url: str, check, timeout: float) -> dict:
    """Poll /health until `check(body)`; the last body."""
    async with asyncio.timeout(timeout):
        while True:
            health = await _health(http, url)
            if check(health):
                return health
            await asyncio.sleep(0.2)


async def _everyone_back(url: str, timeout: float) -> tuple[float, dict[str, float]]:
    """Seconds until every service instance answers micro PING, the KV events stream
    exists; and when each came back (from a fresh client of the new server)."""
    start = time.monotonic()
    back: dict[str, float] = {}
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=5)
    try:
        async with asyncio.timeout(timeout):
            while len(back) < len(TOPOLOGY):
                for reply in await discover(nc, timeout=0.2):
                    sid = (reply.get("metadata") or {}).get("service_id", "")
                    back.setdefault(sid, time.monotonic() - start)
            js = nc.jetstream()
            while True:
                try:
                    await js.stream_info(STREAM_NAME)
                    break
                except nats.js.errors.NotFoundError:
                    await asyncio.sleep(0.2)
    finally:
        await nc.close()
    return time.monotonic() - start, back


async def test_nats_restart_under_load_every_service_reconnects_within_10s_and_serves(chaos, http):
    case, want = CASES["nats_restart"], chaos.want["nats_restart"]
    load = Load(http, chaos.url, case, want, concurrency=2)
    try:
        await load.start()
        await load.wait_completed(3, timeout=60)
        chaos.kill_nats()
        await asyncio.sleep(1.0)  # the services see the connection drop
        started = len(load.sent)
        chaos.start_nats()  # same port, no JetStream state
        took, back = await _everyone_back(chaos.nats_url, timeout=30)
        assert set(back) == set(TOPOLOGY), back
        assert took < 10, back
        await _until(http, chaos.url, lambda h: h.get("http") == 200, 15)  # workers back
        await load.wait_completed(load.completed + 4, timeout=60)
        await load.stop()
        # the KV index is fed again: a new prompt's pages reach it from the new stream
        keys_before = (await _health(http, chaos.url))["kv_index_keys"]
        fresh = await complete(http, chaos.url, prompt_ids(90, seed=70), 4, False)
        assert fresh.ok, fresh
        await _until(http, chaos.url, lambda h: h.get("kv_index_keys", 0) > keys_before, 10)
    finally:
        await load.stop()
    assert all(chaos.alive().values()), chaos.alive()
    assert load.wrong() == [], load.wrong()
    # requests caught by the outage may fail, with a clear error, never a hang
    for sent in load.failed():
        assert sent.outcome.status >= 500 and sent.outcome.error, sent
        assert sent.outcome.seconds < 60, sent
    after = [s for s in load.sent[started:] if s.outcome.ok]
    assert len(after) >= 4
