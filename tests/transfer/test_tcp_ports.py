"""Silent, slow and token-less peers cannot hold a TCP transfer port (real loopback sockets):
an idle-connection flood does not stop a transfer, a slow-loris peer is cut at its
deadline, the per-IP cap refuses the excess, and the server's one refusal reply does not
tell an unknown region from a wrong token. Deadlines and caps: tcp/admission.py."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest
import structlog

from libs.common.transfer.tcp.engine import TcpTransferEngine
from libs.common.transfer.tcp.frame import (
    FLAG_LAST,
    KIND_ACK,
    KIND_ERR,
    KIND_WRITE,
    REQUEST,
    RESPONSE,
    pack_request,
)

FLOOD = 300  # silent connections per source address, as in the incident
SHORT = 0.5  # the deadlines of the `strict` engine, seconds
TICK = SHORT / 8  # ServerLimits.tick_s: a deadline is enforced within one tick
SLACK = 1.0  # scheduling on a loaded 2-core host


def _connect(endpoint: str, source: str = "127.0.0.1") -> socket.socket:
    host, port = endpoint.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))
    sock.settimeout(5)
    return sock


def _flood(endpoint: str, count: int, source: str) -> list[socket.socket]:
    """`count` silent connections from `source` (bounded: 5 s each at most)."""
    return [_connect(endpoint, source) for _ in range(count)]


def _closed_after(sock: socket.socket, limit_s: float = 10.0) -> tuple[float, bytes]:
    """Seconds until the server closes `sock`, and what it sent before."""
    start, data = time.monotonic(), b""
    sock.settimeout(limit_s)
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return time.monotonic() - start, data
        data += chunk


def _op(desc, *, token: bytes | None = None, region_id: int | None = None, length: int = 16,
        op_index: int = 0, batch_id: int = 1) -> bytes:  # fmt: skip
    header = pack_request(
        KIND_WRITE,
        FLAG_LAST,
        op_index,
        batch_id,
        region_id=desc.region_id if region_id is None else region_id,
        offset=0,
        length=length,
        token=desc.token_bytes if token is None else token,
    )
    return header + b"\x5a" * length


def _ack(sock: socket.socket) -> int:
    reply = sock.recv(RESPONSE.size, socket.MSG_WAITALL)
    return RESPONSE.unpack(reply)[2]


@pytest.fixture
async def strict():
    """A server with short deadlines and a per-IP cap of 4."""
    engine = TcpTransferEngine(first_frame_timeout_s=SHORT, frame_timeout_s=SHORT,
                               max_connections_per_ip=4, batch_timeout_s=10.0)  # fmt: skip
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def test_a_flood_of_silent_connections_before_the_first_transfer_does_not_stop_it() -> None:
    """300 silent connections from each of two loopback addresses (600, over the server's
    256 slots), opened before any byte moved; then writes and a read from a peer engine
    succeed at once, with the server's default limits."""
    server = TcpTransferEngine(batch_timeout_s=10.0)
    client = TcpTransferEngine(batch_timeout_s=10.0)
    await server.start()
    await client.start()
    flood: list[socket.socket] = []
    try:
        dst = bytearray(8 << 20)
        d_dst = server.register(dst)
        started = time.monotonic()
        for source in ("127.0.0.1", "127.0.0.2"):
            flood += await asyncio.to_thread(_flood, d_dst.endpoint, FLOOD, source)
        opened_s = time.monotonic() - started
        kept = server.info()["server_connections"]
        assert kept <= 2 * 64, kept  # the per-IP cap (64) holds each address
        src = bytes(os.urandom(8 << 20))
        d_src = client.register(bytearray(src))
        started = time.monotonic()
        async with asyncio.timeout(10):
            await client.write(d_src, d_dst, [(0, 0, 4096)])  # a small batch, one lane
            await client.write(d_src, d_dst, [(0, 0, 8 << 20)])  # spread over three
            back = bytearray(8 << 20)
            d_back = client.register(back)
            await client.read(d_back, d_dst, [(0, 0, 8 << 20)])
        took_s = time.monotonic() - started
        assert dst == src and back == src
        print(f"\nflood: {len(flood)} silent connections opened in {opened_s:.2f}s, "
              f"server kept {kept}; then 4 KiB + 8 MiB writes and an 8 MiB read "
              f"in {took_s * 1000:.0f} ms")  # fmt: skip
    finally:
        for sock in flood:
            sock.close()
        await client.stop()
        await server.stop()


async def test_a_silent_connection_is_closed_at_the_first_frame_deadline(strict) -> None:
    desc = strict.register(bytearray(64))
    sock = await asyncio.to_thread(_connect, desc.endpoint)
    took, data = await asyncio.to_thread(_closed_after, sock)
    sock.close()
    assert data == b""
    assert SHORT - 0.05 <= took <= SHORT + TICK + SLACK, took
    print(f"\nsilent connection closed after {took:.3f}s (first-frame deadline {SHORT}s)")


async def test_a_slow_loris_header_is_cut_at_the_deadline_proven_or_not(strict) -> None:
    """One byte of a valid header every 50 ms: an unproven connection is closed at its
    first-frame deadline, a proven one (it already moved bytes) at the frame deadline
    counted from the header's first byte; neither gets to finish its 64 bytes."""
    dst = bytearray(64)
    desc = strict.register(dst)

    def trickle(sock: socket.socket) -> float:
        header = _op(desc, length=0)
        start = time.monotonic()
        try:
            for i in range(REQUEST.size):
                sock.send(header[i : i + 1])
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - start
        raise AssertionError("the whole slow header was taken")

    with structlog.testing.capture_logs() as logs:
        fresh = await asyncio.to_thread(_connect, desc.endpoint)
        unproven_s = await asyncio.to_thread(trickle, fresh)
        proven = await asyncio.to_thread(_connect, desc.endpoint)
        await asyncio.to_thread(proven.sendall, _op(desc))
        assert await asyncio.to_thread(_ack, proven) == KIND_ACK
        proven_s = await asyncio.to_thread(trickle, proven)
    fresh.close()
    proven.close()
    # A send fails one round trip after the close: allow a tick and a byte's 50 ms.
    for took in (unproven_s, proven_s):
        assert SHORT - 0.05 <= took <= SHORT + TICK + 0.1 + SLACK, (unproven_s, proven_s)
    slow = [e for e in logs if e["event"] == "transfer peer too slow: connection closed"]
    assert [e["proven"] for e in slow] == [False, True], logs
    print(f"\nslow loris header: cut after {unproven_s:.2f}s (unproven), "
          f"{proven_s:.2f}s (proven), deadline {SHORT}s")  # fmt: skip


async def test_a_slow_payload_is_cut_at_its_budget_and_lands_only_in_its_range(strict) -> None:
    """A valid 64 KiB write sent at 10 KiB/s (under the 1 MiB/s floor): cut after
    frame_timeout_s + 64 KiB / (1 MiB/s), about 0.56 s."""
    dst = bytearray(b"\x11" * (128 << 10))
    desc = strict.register(dst)
    header = _op(desc, length=64 << 10)[: REQUEST.size]

    def slow() -> float:
        with _connect(desc.endpoint) as sock:
            sock.sendall(header)
            start = time.monotonic()
            try:
                for _ in range(128):  # 64 KiB in 512-byte pieces, 20 per second
                    sock.send(b"\x22" * 512)
                    time.sleep(0.05)
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - start
        raise AssertionError("the slow payload was taken")

    took = await asyncio.to_thread(slow)
    budget = SHORT + (64 << 10) / (1 << 20)
    assert budget - 0.05 <= took <= budget + TICK + 0.1 + SLACK, took
    print(f"\nslow payload cut after {took:.2f}s (budget {budget:.3f}s)")
    written = dst.rstrip(b"\x11")
    assert set(written) <= {0x22} and len(written) < 64 << 10
    assert dst[64 << 10 :] == b"\x11" * (64 << 10)


async def test_a_token_less_peer_chattering_refused_ops_is_closed_at_the_first_frame_deadline(
    strict,
) -> None:
    desc = strict.register(bytearray(64))

    def chatter() -> tuple[int, float]:
        errs, start = 0, time.monotonic()
        with _connect(desc.endpoint) as sock:
            try:
                for i in range(100):  # 10 s at most
                    sock.sendall(_op(desc, token=bytes(16), batch_id=i + 1))
                    reply = sock.recv(RESPONSE.size, socket.MSG_WAITALL)
                    if not reply:
                        break
                    assert RESPONSE.unpack(reply)[2] == KIND_ERR
                    sock.recv(RESPONSE.unpack(reply)[-1], socket.MSG_WAITALL)
                    errs += 1
                    time.sleep(0.1)
            except (BrokenPipeError, ConnectionResetError):
                pass
        return errs, time.monotonic() - start

    errs, took = await asyncio.to_thread(chatter)
    assert errs >= 2, errs
    assert SHORT - 0.05 <= took <= SHORT + 0.1 + TICK + SLACK, took
    print(f"\ntoken-less peer: {errs} ERR replies, closed after {took:.2f}s")


async def test_a_token_less_peer_pipelining_refused_ops_nonstop_is_closed_in_time(strict) -> None:
    """Wrong-token ops back to back (the server never has to wait for one), replies read
    by another thread: closed at the first-frame deadline all the same."""
    desc = strict.register(bytearray(64))
    sock = await asyncio.to_thread(_connect, desc.endpoint)
    ops = b"".join(_op(desc, token=bytes(16), batch_id=i + 1) for i in range(64))

    def send() -> int:
        sent, end = 0, time.monotonic() + 10
        try:
            while time.monotonic() < end:
                sock.sendall(ops)
                sent += 64
        except OSError:  # closed by the server
            pass
        return sent

    sender = asyncio.create_task(asyncio.to_thread(send))
    took, answer = await asyncio.to_thread(_closed_after, sock)
    sent = await sender
    sock.close()
    assert answer.count(b"unknown region or wrong token") >= 10, len(answer)
    assert SHORT - 0.05 <= took <= SHORT + TICK + SLACK, (took, sent)
    print(f"\nnonstop token-less peer: {sent} ops sent, closed after {took:.2f}s")


async def test_a_proven_connection_may_idle_past_every_deadline(strict) -> None:
    """Peers pool their connections: one that moved bytes is kept while it is quiet."""
    dst = bytearray(64)
    desc = strict.register(dst)

    def idle_then_write() -> tuple[int, int]:
        with _connect(desc.endpoint) as sock:
            sock.sendall(_op(desc))
            first = _ack(sock)
            time.sleep(3 * SHORT)
            sock.sendall(_op(desc, batch_id=2))
            return first, _ack(sock)

    assert await asyncio.to_thread(idle_then_write) == (KIND_ACK, KIND_ACK)


async def test_an_engine_whose_unused_lanes_were_closed_still_transfers(strict) -> None:
    """The client pools 3 connections; a small write uses one, the server closes the two
    silent ones at the first-frame deadline; a later large batch opens them again."""
    client = TcpTransferEngine(batch_timeout_s=10.0)
    await client.start()
    try:
        dst = bytearray(4 << 20)
        d_dst = strict.register(dst)
        src = os.urandom(4 << 20)
        d_src = client.register(bytearray(src))
        await client.write(d_src, d_dst, [(0, 0, 4096)])
        await asyncio.sleep(SHORT + TICK + 0.5)
        assert strict.info()["server_connections"] == 1
        await client.write(d_src, d_dst, [(0, 0, 4 << 20)])
        assert dst == src
    finally:
        await client.stop()


async def test_the_per_ip_cap_refuses_the_excess_and_other_addresses_are_served(strict) -> None:
    desc = strict.register(bytearray(64))

    def scenario() -> tuple[float, bytes, int]:
        proven = []
        for i in range(4):  # the cap: 4 connections that each moved bytes
            sock = _connect(desc.endpoint)
            sock.sendall(_op(desc, batch_id=i + 1))
            assert _ack(sock) == KIND_ACK
            proven.append(sock)
        excess = _connect(desc.endpoint)
        try:
            excess.sendall(_op(desc))
        except (BrokenPipeError, ConnectionResetError):
            pass
        took, data = _closed_after(excess)
        with _connect(desc.endpoint, "127.0.0.2") as other:
            other.sendall(_op(desc))
            served = _ack(other)
        for sock in [*proven, excess]:
            sock.close()
        return took, data, served

    with structlog.testing.capture_logs() as logs:
        took, data, served = await asyncio.to_thread(scenario)
    assert data == b"" and took < SHORT, took  # closed at once, not at a deadline
    assert served == KIND_ACK
    refused = [e for e in logs if e["event"] == "transfer connection refused: too many"]
    assert len(refused) == 1 and refused[0]["from_ip"] == 4, logs


async def test_unknown_region_and_wrong_token_get_byte_identical_replies(strict) -> None:
    real = strict.register(bytearray(4096))
    gone = strict.register(bytearray(4096))
    strict.unregister(gone)

    def reply(payload: bytes) -> bytes:
        with _connect(real.endpoint) as sock:
            sock.sendall(payload)
            head = sock.recv(RESPONSE.size, socket.MSG_WAITALL)
            return head + sock.recv(RESPONSE.unpack(head)[-1], socket.MSG_WAITALL)

    cases = {
        "unknown region": _op(real, region_id=real.region_id ^ 0x5A5A, op_index=7, batch_id=3),
        "wrong token": _op(real, token=os.urandom(16), op_index=7, batch_id=3),
        "unregistered region, its old token": _op(gone, op_index=7, batch_id=3),
    }
    with structlog.testing.capture_logs() as logs:
        replies = {name: await asyncio.to_thread(reply, op) for name, op in cases.items()}
    assert len(set(replies.values())) == 1, replies
    answer = replies["wrong token"]
    assert RESPONSE.unpack(answer[: RESPONSE.size])[2] == KIND_ERR
    assert str(real.region_id).encode() not in answer
    # the operator's log still tells them apart
    reasons = sorted(e["reason"].split(" ")[0] for e in logs if e["event"] == "transfer op refused")
    assert reasons == ["unknown", "unknown", "wrong"], logs
