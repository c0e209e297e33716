"""TCP transport: bytes land exactly where the ops say, over real loopback sockets."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
import torch

from libs.common.transfer import TransferError
from libs.common.transfer.descriptor import RegionDescriptor
from libs.common.transfer.tcp.engine import TcpTransferEngine


async def test_write_then_read_moves_exact_bytes(tcp_pair) -> None:
    a, b = tcp_pair
    src = torch.arange(4096, dtype=torch.float32)  # 16 KiB, registered as a tensor
    dst = bytearray(32 << 10)
    back = torch.zeros(4096, dtype=torch.float32)
    d_src, d_dst, d_back = a.register(src), b.register(dst), a.register(back)
    await a.write(d_src, d_dst, [(0, 1000, 8000), (8000, 20000, 8384)])
    raw = src.numpy().tobytes()
    assert dst[1000:9000] == raw[:8000] and dst[20000:28384] == raw[8000:]
    assert dst[:1000] == bytes(1000) and dst[9000:20000] == bytes(11000)
    await a.read(d_back, d_dst, [(0, 1000, 8000), (8000, 20000, 8384)])
    assert torch.equal(back, src)


async def test_large_ops_are_sliced_over_several_connections(tcp_pair) -> None:
    a, b = tcp_pair  # a: 2 connections per peer, 64 KiB slices
    payload = os.urandom(3 << 20)
    src, dst = bytearray(payload), bytearray(3 << 20)
    d_src, d_dst = a.register(src), b.register(dst)
    await a.write(d_src, d_dst, [(0, 0, 3 << 20)])
    assert dst == payload
    assert len(a._peers[d_dst.endpoint]) == 2
    out = bytearray(3 << 20)
    await a.read(a.register(out), d_dst, [(0, 0, 1 << 20), (1 << 20, 1 << 20, 2 << 20)])
    assert out == payload


async def test_many_batches_in_flight_complete_independently(tcp_pair) -> None:
    a, b = tcp_pair
    src = bytearray(os.urandom(64 * 4096))
    dst = bytearray(64 * 4096)
    d_src, d_dst = a.register(src), b.register(dst)
    batches = [a.write(d_src, d_dst, [(i * 4096, i * 4096, 4096)]) for i in range(64)]
    async with asyncio.timeout(20):
        await asyncio.gather(*batches)
    assert dst == src


async def test_empty_batch_completes_at_once(tcp_pair) -> None:
    a, b = tcp_pair
    await a.write(a.register(bytearray(8)), b.register(bytearray(8)), [])


async def test_wrong_token_is_refused_naming_peer_and_op(tcp_pair) -> None:
    a, b = tcp_pair
    dst = bytearray(4096)
    d_src, d_dst = a.register(bytearray(b"x" * 4096)), b.register(dst)
    forged = RegionDescriptor.from_dict({**d_dst.to_dict(), "token": "00" * 16})
    with pytest.raises(TransferError, match="wrong token") as info:
        await a.write(d_src, forged, [(0, 0, 16), (0, 100, 16)])
    assert info.value.peer == d_dst.endpoint and info.value.op_index == 0
    assert d_dst.endpoint in str(info.value) and "op 0" in str(info.value)
    assert dst == bytes(4096)
    await a.write(d_src, d_dst, [(0, 0, 16)])  # the connection still serves good batches
    assert dst[:16] == b"x" * 16


async def test_stale_descriptor_is_refused_after_unregister(tcp_pair) -> None:
    a, b = tcp_pair
    dst = bytearray(64)
    d_src, d_dst = a.register(bytearray(b"y" * 64)), b.register(dst)
    b.unregister(d_dst)
    with pytest.raises(TransferError, match="unknown region"):
        await a.write(d_src, d_dst, [(0, 0, 64)])
    with pytest.raises(TransferError, match="unknown region"):
        await a.read(d_src, d_dst, [(0, 0, 64)])
    assert dst == bytes(64)


async def test_forged_length_cannot_reach_past_the_region(tcp_pair) -> None:
    a, b = tcp_pair
    backing = bytearray(8192)
    region = memoryview(backing)[:4096]  # the peer registered only the first half
    d_src, d_dst = a.register(bytearray(b"z" * 8192)), b.register(region)
    forged = RegionDescriptor.from_dict({**d_dst.to_dict(), "length": 1 << 40})
    with pytest.raises(TransferError, match="outside region") as info:
        await a.write(d_src, forged, [(0, 0, 1024), (0, 4000, 200)])
    assert info.value.op_index == 1
    assert backing[4096:] == bytes(4096)  # nothing outside the region was written
    with pytest.raises(TransferError, match="outside region"):
        await a.read(d_src, forged, [(0, 4096, 1)])


async def test_bad_ops_are_refused_before_anything_is_sent(tcp_pair) -> None:
    a, b = tcp_pair
    d_src, d_dst = a.register(bytearray(64)), b.register(bytearray(64))
    for ops in ([(0, 0, -1)], [(0, 60, 8)], [(0, (1 << 64) - 1, 2)]):
        with pytest.raises(ValueError, match=r"ops\[0\]"):
            await a.write(d_src, d_dst, ops)
    with pytest.raises(ValueError, match="local"):
        await a.write(d_dst, d_dst, [(0, 0, 1)])  # b's region is not a's


async def test_unreachable_peer_fails_the_batch_with_its_name(tcp_pair) -> None:
    a, b = tcp_pair
    d_src, d_dst = a.register(bytearray(64)), b.register(bytearray(64))
    await b.stop()
    with pytest.raises(TransferError, match=d_dst.endpoint):
        await a.write(d_src, d_dst, [(0, 0, 64)])


async def test_peer_that_dies_mid_batch_fails_batches_in_flight(tcp_pair) -> None:
    a, b = tcp_pair
    src, dst = bytearray(8 << 20), bytearray(8 << 20)
    d_src, d_dst = a.register(src), b.register(dst)
    await a.write(d_src, d_dst, [(0, 0, 1)])  # connect
    writes = asyncio.gather(
        *(a.write(d_src, d_dst, [(0, 0, 8 << 20)]) for _ in range(8)), return_exceptions=True
    )
    await asyncio.sleep(0)
    await b.stop()
    async with asyncio.timeout(20):
        results = await writes
    failed = [r for r in results if isinstance(r, TransferError)]
    assert all(isinstance(r, TransferError) or r is None for r in results)
    assert all(d_dst.endpoint in str(r) for r in failed)


@pytest.mark.parametrize("poll_us, thread_bytes", [(0.0, 0), (50.0, 1 << 19)])
async def test_batches_land_exactly_with_and_without_busy_polling(
    poll_us: float, thread_bytes: int
) -> None:
    # Default slices: a 1 MiB + 3 op is cut into two odd halves, one per connection
    # (sent from worker threads when thread_bytes is set); the 4 KiB op goes whole to
    # one connection and (poll_us > 0) is busy-polled.
    options = {"busy_poll_us": poll_us, "thread_send_bytes": thread_bytes}
    a, b = TcpTransferEngine(**options), TcpTransferEngine(**options)
    async with a, b:
        size = (1 << 20) + 3
        payload = os.urandom(size)
        src, dst, back = bytearray(payload), bytearray(size + 5 + 4096), bytearray(size)
        d_src, d_dst, d_back = a.register(src), b.register(dst), a.register(back)
        for _ in range(3):
            await a.write(d_src, d_dst, [(0, 5, size)])
            await a.write(d_src, d_dst, [(0, size + 5, 4096)])
            await a.read(d_back, d_dst, [(0, 5, size)])
        assert dst[5 : size + 5] == payload and dst[size + 5 :] == payload[:4096]
        assert back == payload and a.info()["peer_connections"] == 3


async def test_stop_wakes_a_send_thread_blocked_on_a_peer_that_never_reads() -> None:
    # The peer accepts and never reads: a 32 MiB part fills the socket buffers and its
    # worker thread blocks in sendmsg; stop() must fail the batch and return.
    with socket.create_server(("127.0.0.1", 0)) as sink:
        endpoint = f"127.0.0.1:{sink.getsockname()[1]}"
        remote = RegionDescriptor("tcp", endpoint, 1, 64 << 20, "00" * 16)
        a = TcpTransferEngine(connections_per_peer=1, batch_timeout_s=60.0, stall_timeout_s=60.0)
        await a.start()
        src = a.register(bytearray(32 << 20))
        write = asyncio.ensure_future(a.write(src, remote, [(0, 0, 32 << 20)]))
        await asyncio.sleep(0.3)
        assert not write.done()
        async with asyncio.timeout(10):
            await a.stop()
            with pytest.raises(TransferError, match=endpoint):
                await write


async def test_a_small_write_whose_ack_never_comes_times_out_and_drops_the_connection() -> None:
    # The small-batch path (one part, busy-polled ACK, awaited inline) must still end in
    # a TransferError at batch_timeout_s, and close the connection so that a late ACK
    # can never be taken for a later batch's: the next write opens a new one.
    with socket.create_server(("127.0.0.1", 0)) as sink:
        endpoint = f"127.0.0.1:{sink.getsockname()[1]}"
        remote = RegionDescriptor("tcp", endpoint, 1, 1 << 20, "00" * 16)
        a = TcpTransferEngine(connections_per_peer=1, batch_timeout_s=0.3)
        await a.start()
        try:
            src = a.register(bytearray(4096))
            with pytest.raises(TransferError, match="timed out"):
                await a.write(src, remote, [(0, 0, 4096)])
            (first,) = a._peers[endpoint]
            assert not first.alive
            with pytest.raises(TransferError, match="timed out"):
                await a.write(src, remote, [(0, 0, 4096)])
            (second,) = a._peers[endpoint]
            assert second is not first
        finally:
            await a.stop()


async def test_a_small_batch_of_more_buffers_than_one_sendmsg_takes_lands_whole(
    tcp_pair,
) -> None:
    # 1,500 ops of 16 bytes: 3,000 buffers, over IOV_MAX, yet under busy_poll_bytes, so
    # the inline send goes out in several sendmsg calls before its ACK is polled.
    a, b = tcp_pair
    n, size = 1500, 16
    payload = os.urandom(n * size)
    src, dst, back = bytearray(payload), bytearray(2 * n * size), bytearray(n * size)
    d_src, d_dst, d_back = a.register(src), b.register(dst), a.register(back)
    ops = [(i * size, 2 * i * size, size) for i in range(n)]
    await a.write(d_src, d_dst, ops)
    assert all(dst[2 * i * size : (2 * i + 1) * size] == payload[i * size : (i + 1) * size]
               for i in range(n))  # fmt: skip
    assert all(dst[(2 * i + 1) * size : (2 * i + 2) * size] == bytes(size) for i in range(n))
    await a.read(d_back, d_dst, ops)
    assert back == payload
