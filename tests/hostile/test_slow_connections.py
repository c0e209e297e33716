"""1,000 slow or idle sockets held open against a real router in front of real workers
(tests/hostile/conftest.py's cluster, with a router of this module's own: short
timeouts, and a per-address cap that the 1,000 sockets from 127.0.0.1 exactly fill).

While they are held, a client from another address (127.0.0.2) polls /health and runs a
short completion; the next connection from 127.0.0.1 is refused with 429. After the
timeouts, the router has closed every one of the 1,000 (the test reads EOF), with a 408
where the client had begun a request. services/router/api/connections.py does the work;
tests/router/test_router_connections.py checks each limit alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import statistics
import time
from collections.abc import Iterator

import aiohttp
import pytest

from tests.hostile.conftest import API_KEY, Hostile
from tests.router.conftest import Routers
from tests.router.e2e_cluster import wait_healthy

pytestmark = pytest.mark.slow

SOCKETS = 1000  # a third idle, a third dripping headers, a third stalled in a 10 MB body
HEADER_TIMEOUT, BODY_TIMEOUT = 8.0, 10.0
FLAGS = ["--api-key", API_KEY, "--header-timeout", str(HEADER_TIMEOUT),
         "--body-timeout", str(BODY_TIMEOUT), "--max-connections-per-address", str(SOCKETS),
         "--max-connections", str(SOCKETS + 64)]  # fmt: skip
HEALTH_BOUND_S = 0.1  # the /health latency the router keeps while the sockets are held
OTHER = "127.0.0.2"  # the well-behaved client's address (Linux routes 127/8 to lo)


@pytest.fixture(scope="module")
def router_url(hostile: Hostile) -> Iterator[str]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 4 * SOCKETS:  # the router inherits it
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    routers = Routers(hostile.nats.url, hostile.logs)
    try:
        url = routers.start("router-conns", *FLAGS)
        asyncio.run(wait_healthy(url, {"prefill": 1, "decode": 1}, 120, hostile.cluster.procs))
        yield url
    finally:
        routers.stop()


async def _open_all(port: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]]:
    """SOCKETS connections from 127.0.0.1 (and when each opened), opened within 60 s;
    each begins its kind."""
    socks = []
    deadline = time.monotonic() + 60
    for i in range(SOCKETS):
        assert time.monotonic() < deadline, f"only {i} sockets opened in 60 s"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        if i % 3 == 1:
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        elif i % 3 == 2:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}"
            writer.write(f"{head}\r\nContent-Length: 10000000\r\n\r\n".encode() + b" " * 1024)
        socks.append((reader, writer, time.monotonic()))
    return socks


async def _drip(writers: list[asyncio.StreamWriter], stop: asyncio.Event) -> None:
    """A header byte to each dripping socket every 0.5 s until `stop` (or 120 rounds)."""
    for _ in range(240):
        for w in writers:
            if not w.is_closing():
                with contextlib.suppress(ConnectionError):
                    w.write(b"X")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
        if stop.is_set():
            return


async def _until_eof(reader: asyncio.StreamReader, timeout: float) -> tuple[bytes, float]:
    """What the router sent before closing, and when it closed; raises TimeoutError if it
    does not close."""
    got = b""
    async with asyncio.timeout(timeout):
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                got += chunk
    return got, time.monotonic()


async def _health_polls(http: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> list:
    """/health latencies, one poll each 50 ms until `stop` (at most 2,000 polls)."""
    latencies = []
    for _ in range(2000):
        start = time.monotonic()
        async with http.get(f"{url}/health") as r:
            assert r.status == 200, await r.text()
            await r.read()
        latencies.append(time.monotonic() - start)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)
        if stop.is_set():
            break
    return latencies


async def test_the_router_serves_while_1000_slow_sockets_are_held_and_then_closes_them(
    router_url: str, hostile: Hostile
):
    port = int(router_url.rsplit(":", 1)[1])
    connector = aiohttp.TCPConnector(local_addr=(OTHER, 0), limit=4)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession(connector=connector, headers=headers) as http:
        opened = time.monotonic()
        socks = await _open_all(port)
        held_until = opened + HEADER_TIMEOUT  # the first of them times out from here
        stop = asyncio.Event()
        dripping = [w for i, (_, w, _) in enumerate(socks) if i % 3 == 1]
        drip = asyncio.create_task(_drip(dripping, stop))
        polls = asyncio.create_task(_health_polls(http, router_url, stop))
        try:
            # The per-address cap is full: one more from 127.0.0.1 is answered 429.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            refused, _ = await _until_eof(reader, 5)
            writer.close()
            # A short completion from another address is served meanwhile.
            body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 2,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            async with http.post(f"{router_url}/v1/completions", json=body) as r:
                out = await r.json()
                assert r.status == 200, out
            served_within = time.monotonic() < held_until
            # Until the first timeout, /health is polled beside the held sockets.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, held_until - time.monotonic()))
        finally:
            stop.set()
            latencies = await polls
        closed = await asyncio.gather(
            *(_until_eof(r, BODY_TIMEOUT + 15) for r, _, _ in socks), return_exceptions=True
        )
        await drip
        for _, w, _ in socks:
            w.close()
        async with http.get(f"{router_url}/metrics") as r:
            metrics = await r.text()

    assert refused.startswith(b"HTTP/1.1 429"), refused[:200]
    assert b"--max-connections-per-address" in refused
    assert out["usage"]["completion_tokens"] == 2, out
    assert served_within, "the completion took past the first socket's timeout"
    assert len(latencies) >= 20, latencies
    assert max(latencies) < HEALTH_BOUND_S, (
        f"/health max {max(latencies) * 1000:.0f} ms, "
        f"median {statistics.median(latencies) * 1000:.0f} ms over {len(latencies)} polls"
    )
    not_closed = [i for i, c in enumerate(closed) if isinstance(c, BaseException)]
    assert not not_closed, f"{len(not_closed)} sockets still open, e.g. #{not_closed[:5]}"
    answers = [c[0] for c in closed if isinstance(c, tuple)]
    assert all(a == b"" for a in answers[0::3]), "an idle socket got bytes"
    began = answers[1::3] + answers[2::3]
    assert all(a.startswith(b"HTTP/1.1 408") for a in began), [
        a[:80] for a in began if not a.startswith(b"HTTP/1.1 408")
    ][:3]
    # Each held until its own deadline (headers: from its open; a body: from its headers,
    # sent at the open), not cut early, and closed soon after.
    for i, c in enumerate(closed):
        assert isinstance(c, tuple)
        held = c[1] - socks[i][2]
        deadline = BODY_TIMEOUT if i % 3 == 2 else HEADER_TIMEOUT
        assert deadline - 0.5 < held < deadline + 5, (i, held)
    refused = {
        line.split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("tandem:http_connections_refused_total{")
    }
    assert refused.get("header_timeout", 0) >= 2 * SOCKETS // 3, refused
    assert refused.get("body_timeout", 0) >= SOCKETS // 3, refused
    assert refused.get("max_connections_per_address", 0) >= 1, refused
    assert not hostile.dead(), f"exited: {hostile.dead()}"
