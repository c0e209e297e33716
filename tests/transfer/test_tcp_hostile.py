"""A hostile or broken peer on the TCP port: refused, logged, nothing stray written."""

from __future__ import annotations

import asyncio
import os
import socket

import structlog

from libs.common.transfer.tcp.frame import (
    FLAG_LAST,
    KIND_ACK,
    KIND_ERR,
    KIND_WRITE,
    RESPONSE,
    pack_request,
)
from tests.transfer.conftest import connect_raw


def _recv_all(sock: socket.socket, limit: int = 1 << 16) -> bytes:
    chunks = []
    for _ in range(64):  # bounded: the server answers once, then closes or idles
        try:
            chunk = sock.recv(limit)
        except TimeoutError:
            break
        except ConnectionResetError:  # closed with our garbage unread: a reset
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


async def _events_until(logs: list[dict], event: str, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if any(e["event"] == event for e in logs):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no {event!r} in {logs}")


async def test_garbage_header_closes_the_connection_and_is_logged(tcp_pair) -> None:
    a, b = tcp_pair
    dst = bytearray(4096)
    d_dst = b.register(dst)
    with structlog.testing.capture_logs() as logs:
        sock = connect_raw(d_dst.endpoint)
        sock.sendall(os.urandom(64) + b"\xff" * 4096)
        assert await asyncio.to_thread(_recv_all, sock) == b""  # closed, no answer
        sock.close()
        await _events_until(logs, "transfer refused garbage header")
    assert dst == bytes(4096)
    d_src = a.register(bytearray(b"k" * 16))
    await a.write(d_src, d_dst, [(0, 0, 16)])  # the server still serves others
    assert dst[:16] == b"k" * 16


async def test_oversized_frame_is_refused_without_reading_it(tcp_pair) -> None:
    _, b = tcp_pair
    d_dst = b.register(bytearray(64))
    with structlog.testing.capture_logs() as logs:
        sock = connect_raw(d_dst.endpoint)
        sock.sendall(
            pack_request(
                KIND_WRITE,
                1,
                0,
                1,
                region_id=d_dst.region_id,
                offset=0,
                length=1 << 62,
                token=d_dst.token_bytes,
            )
        )
        assert await asyncio.to_thread(_recv_all, sock) == b""
        sock.close()
        await _events_until(logs, "transfer refused oversized frame")


async def test_wrong_token_on_the_wire_gets_err_and_payload_is_discarded(tcp_pair) -> None:
    _, b = tcp_pair
    dst = bytearray(4096)
    d_dst = b.register(dst)
    with structlog.testing.capture_logs() as logs:
        sock = connect_raw(d_dst.endpoint)
        header = pack_request(
            KIND_WRITE,
            1,
            3,
            9,
            region_id=d_dst.region_id,
            offset=0,
            length=4096,
            token=os.urandom(16),
        )
        sock.sendall(header + b"\xee" * 4096)
        reply = await asyncio.to_thread(sock.recv, RESPONSE.size, socket.MSG_WAITALL)
        _, _, kind, _, op_index, _, batch_id, length = RESPONSE.unpack(reply)
        assert (kind, op_index, batch_id) == (KIND_ERR, 3, 9)
        reason = await asyncio.to_thread(sock.recv, length, socket.MSG_WAITALL)
        assert b"wrong token" in reason and d_dst.token.encode() not in reason
        sock.close()
        await _events_until(logs, "transfer op refused")
    assert dst == bytes(4096)
    refused = [e for e in logs if e["event"] == "transfer op refused"]
    assert "token" not in refused[0] and refused[0]["reason"].startswith("wrong token")


async def test_disconnect_mid_payload_writes_only_inside_the_range(tcp_pair) -> None:
    _, b = tcp_pair
    dst = bytearray(b"\x11" * 8192)
    d_dst = b.register(dst)
    with structlog.testing.capture_logs() as logs:
        sock = connect_raw(d_dst.endpoint)
        header = pack_request(
            KIND_WRITE,
            1,
            0,
            1,
            region_id=d_dst.region_id,
            offset=1024,
            length=4096,
            token=d_dst.token_bytes,
        )
        sock.sendall(header + b"\x22" * 1000)  # promises 4096 bytes, sends 1000
        sock.close()
        await _events_until(logs, "transfer peer disconnected mid-payload")
    assert dst[:1024] == b"\x11" * 1024
    assert dst[1024:2024] == b"\x22" * 1000
    assert dst[2024:] == b"\x11" * (8192 - 2024)


async def test_disconnect_mid_header_is_logged(tcp_pair) -> None:
    _, b = tcp_pair
    d_dst = b.register(bytearray(64))
    with structlog.testing.capture_logs() as logs:
        sock = connect_raw(d_dst.endpoint)
        sock.sendall(b"\x00" * 10)
        sock.close()
        await _events_until(logs, "transfer peer disconnected mid-header")


async def test_header_split_across_the_busy_poll_is_still_served(tcp_pair) -> None:
    # The server's busy-poll takes the first bytes of a header, then waits for the
    # rest in a blocking recv: the frame must still be parsed whole.
    _, b = tcp_pair
    dst = bytearray(64)
    d_dst = b.register(dst)
    sock = connect_raw(d_dst.endpoint)
    header = pack_request(
        KIND_WRITE, 1, 0, 7, region_id=d_dst.region_id, offset=8, length=16, token=d_dst.token_bytes
    )
    sock.sendall(header[:20])
    await asyncio.sleep(0.05)  # far past the 50 µs poll budget
    sock.sendall(header[20:] + b"\x33" * 16)
    answer = await asyncio.to_thread(sock.recv, RESPONSE.size)
    sock.close()
    assert RESPONSE.unpack(answer)[2] == KIND_ACK
    assert dst == bytes(8) + b"\x33" * 16 + bytes(40)


async def test_overflowing_offset_on_the_wire_is_refused_and_nothing_is_written(tcp_pair) -> None:
    _, b = tcp_pair
    dst = bytearray(4096)
    d_dst = b.register(dst)
    sock = connect_raw(d_dst.endpoint)
    # offset + length wraps a u64 to 8: a C-style `offset + length <= size` would pass.
    offset = (1 << 64) - 8
    sock.sendall(
        pack_request(
            KIND_WRITE,
            1,
            3,
            1,
            region_id=d_dst.region_id,
            offset=offset,
            length=16,
            token=d_dst.token_bytes,
        )
        + b"\x55" * 16
    )
    sock.settimeout(0.5)  # the ERR, then the server waits for this batch's next op
    answer = await asyncio.to_thread(_recv_all, sock)
    sock.close()
    kind, op_index = RESPONSE.unpack_from(answer)[2], RESPONSE.unpack_from(answer)[4]
    assert kind == KIND_ERR and op_index == 3
    assert b"outside region" in answer[RESPONSE.size :]
    assert dst == bytes(4096)


async def test_a_pipelined_batch_is_acknowledged_once(tcp_pair) -> None:
    _, b = tcp_pair
    dst = bytearray(4096)
    d_dst = b.register(dst)
    sock = connect_raw(d_dst.endpoint)
    ops = [
        pack_request(
            KIND_WRITE,
            FLAG_LAST if i == 7 else 0,
            i,
            42,
            region_id=d_dst.region_id,
            offset=i * 512,
            length=512,
            token=d_dst.token_bytes,
        )
        + bytes([i + 1]) * 512
        for i in range(8)
    ]
    sock.sendall(b"".join(ops))  # eight ops, no round trip between them
    sock.settimeout(0.5)  # past the ACK: anything more would arrive in this time
    answer = await asyncio.to_thread(_recv_all, sock)  # everything the server sends back
    sock.close()
    assert len(answer) == RESPONSE.size  # one ACK for the whole batch, nothing per op
    fields = RESPONSE.unpack(answer)
    assert fields[2] == KIND_ACK and fields[6] == 42
    assert dst == b"".join(bytes([i + 1]) * 512 for i in range(8))
