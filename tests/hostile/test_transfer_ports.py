"""The TCP transfer ports under hostile peers.

- On the real cluster (tests/hostile/conftest.py), before any KV has moved: hundreds of
  silent connections to every worker's and store's transfer port, then a disaggregated
  request succeeds (this once failed: the ports' 256 slots were full of silent peers).
- Random hostile frames: without a region's own token no byte of memory changes or
  leaves, whatever the region id, offset, length or payload; the whole backing memory
  (two registered regions and the unregistered bytes around them) is hashed before and
  after. tests/transfer/ covers each refusal alone (wrong token, stale region, forged
  length, garbage header, oversized frame, disconnects, deadlines, caps); this is the
  randomized sweep.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
import time

import nats
import pytest

from libs.common.messages.control import InfoRequest, ServiceInfo
from libs.common.transfer.tcp.engine import TcpTransferEngine
from libs.common.transfer.tcp.frame import (
    FLAG_LAST,
    KIND_ACK,
    KIND_DATA,
    KIND_ERR,
    KIND_READ,
    KIND_WRITE,
    MAGIC,
    REQUEST,
    RESPONSE,
    VERSION,
    pack_request,
)
from tests.hostile.conftest import PROCESSES, Hostile
from tests.router.e2e_cluster import metric

FRAMES = 2000
PAGE = 4096
FLOOD = 300  # silent connections per transfer port, as in the incident


async def _transfer_info(url: str) -> dict[str, dict]:
    """service id -> its transfer engine's info, for every worker and store."""
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=3)
    try:
        out = {}
        for sid, (service, _) in PROCESSES.items():
            if service in ("prefill", "decode", "cache_store"):
                reply = await nc.request(f"tandem.{service}.{sid}.info", InfoRequest().encode(),
                                         timeout=10)  # fmt: skip
                out[sid] = ServiceInfo.decode(reply.data).details["transfer"]
        return out
    finally:
        await nc.close()


def _silent(endpoint: str, count: int) -> list[socket.socket]:
    host, port = endpoint.rsplit(":", 1)
    return [socket.create_connection((host, int(port)), timeout=5) for _ in range(count)]


@pytest.mark.slow
async def test_a_silent_flood_on_every_transfer_port_before_any_kv_moved_does_not_fail_a_request(
    hostile: Hostile,
):
    """Runs first in this package (conftest orders it, FLOOD_FIRST): no worker has a pooled transfer
    connection yet, so the request's KV writes need new connections to flooded ports, from
    the same address (127.0.0.1) as the flood."""
    before = await _transfer_info(hostile.nats.url)
    assert all(i["transport"] == "tcp" for i in before.values()), before
    assert not any(i["peer_connections"] for i in before.values()), f"KV moved already: {before}"
    flood: list[socket.socket] = []
    try:
        for info in before.values():
            flood += await asyncio.to_thread(_silent, info["endpoint"], FLOOD)
        held = {sid: i["server_connections"]
                for sid, i in (await _transfer_info(hostile.nats.url)).items()}  # fmt: skip
        routed = await metric(hostile.url, "tandem:router_decisions_total", role="prefill")
        prompt = random.Random(5).choices(range(1000, 20000), k=300)  # > --disagg-threshold
        started = time.monotonic()
        out = await hostile.completion_works(prompt)
        took = time.monotonic() - started
        assert await metric(hostile.url, "tandem:router_decisions_total", role="prefill") == (
            routed + 1
        ), "the request was not disaggregated: no KV crossed a transfer port"
        after = await _transfer_info(hostile.nats.url)
        assert after["p1"]["peer_connections"] > 0, after  # prefill wrote into decode's pages
    finally:
        for sock in flood:
            sock.close()
    print(f"\ntransfer ports: {FLOOD} silent connections on each of {sorted(before)}; held "
          f"after the flood {held}; then a disaggregated request of {len(prompt)} tokens "
          f"answered 200 in {took:.2f}s ({out['usage']})")  # fmt: skip


@pytest.fixture
async def server():
    engine = TcpTransferEngine(host="127.0.0.1", port=0, batch_timeout_s=10.0)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


def _frame(rng: random.Random, regions, tokens) -> tuple[bytes, bytes]:
    """One hostile request: header and payload. Never carries the addressed region's token."""
    region_id = rng.choice([*[d.region_id for d in regions], 0, rng.getrandbits(64)])
    own = {d.region_id: d.token_bytes for d in regions}.get(region_id)
    token = rng.choice([t for t in [bytes(16), b"\xff" * 16, rng.randbytes(16), *tokens]
                        if t != own])  # fmt: skip
    offset = rng.choice([0, 1, PAGE - 1, PAGE, 2 * PAGE, 2**63, 2**64 - 1, rng.getrandbits(64)])
    length = rng.choice([0, 1, 16, PAGE, PAGE + 1, 2**30, 2**64 - 1, rng.getrandbits(64)])
    kind = rng.choice([KIND_WRITE, KIND_READ, KIND_WRITE, rng.getrandbits(8)])
    magic, version = rng.choice([(MAGIC, VERSION)] * 6 + [(rng.getrandbits(32), VERSION),
                                                          (MAGIC, rng.getrandbits(8))])  # fmt: skip
    header = REQUEST.pack(magic, version, kind, rng.choice([0, FLAG_LAST]),
                          rng.getrandbits(32), 0, rng.getrandbits(64), region_id, offset,
                          length, token)  # fmt: skip
    payload = b""
    if kind == KIND_WRITE and length <= 2 * PAGE:
        payload = rng.randbytes(length if rng.random() < 0.8 else rng.randrange(length + 1))
    if rng.random() < 0.1:  # a truncated header instead
        return header[: rng.randrange(REQUEST.size)], b""
    return header, payload


def _exchange(endpoint: str, data: bytes) -> bytes:
    """Send `data`, close our side, read the server's answer until it closes."""
    host, port = endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server closed first (garbage header): that is a refusal
            pass
        chunks = []
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def _kinds(answer: bytes) -> list[int]:
    """Kinds of the responses in `answer` (ERR reasons skipped by their length)."""
    kinds, pos = [], 0
    while pos + RESPONSE.size <= len(answer):
        _, _, kind, _, _, _, _, length = RESPONSE.unpack_from(answer, pos)
        kinds.append(kind)
        pos += RESPONSE.size + length
    return kinds


async def test_random_frames_without_the_token_change_and_leak_nothing(server):
    rng = random.Random(1234)
    backing = bytearray(rng.randbytes(5 * PAGE))  # | free | A | free | B | free |
    view = memoryview(backing)
    a = server.register(view[PAGE : 2 * PAGE])
    b = server.register(view[3 * PAGE : 4 * PAGE])
    before = hashlib.sha256(backing).hexdigest()
    tokens = [a.token_bytes, b.token_bytes]
    answers: list[int] = []
    for _ in range(FRAMES):
        header, payload = _frame(rng, [a, b], tokens)
        answer = await asyncio.to_thread(_exchange, a.endpoint, header + payload)
        answers += _kinds(answer)
    assert hashlib.sha256(backing).hexdigest() == before, "a refused frame changed memory"
    assert KIND_DATA not in answers and KIND_ACK not in answers, "a refused frame was served"
    print(f"transfer port: {FRAMES} hostile frames, {answers.count(KIND_ERR)} ERR replies")

    # Control: with the token, a write lands exactly in its range and nowhere else.
    good = pack_request(
        KIND_WRITE,
        FLAG_LAST,
        0,
        7,
        region_id=a.region_id,
        offset=100,
        length=50,
        token=a.token_bytes,
    )
    answer = await asyncio.to_thread(_exchange, a.endpoint, good + b"\xab" * 50)
    assert _kinds(answer) == [KIND_ACK]
    changed = PAGE + 100
    assert backing[changed : changed + 50] == b"\xab" * 50
    rest = backing[:changed] + backing[changed + 50 :]
    reference = random.Random(1234).randbytes(5 * PAGE)  # the memory as first filled
    assert rest == reference[:changed] + reference[changed + 50 :]
