"""Unregistering is a fence: once `unregister` returns, no byte of an op a peer started
earlier lands in the region (a decode worker frees a handoff's pages right after)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import pytest
import structlog

from libs.common.transfer import RegionBusy, TransferError
from libs.common.transfer.shm.segment import Segment
from libs.common.transfer.tcp.engine import TcpTransferEngine
from libs.common.transfer.tcp.frame import KIND_ERR, KIND_WRITE, RESPONSE, pack_request
from tests.transfer.conftest import connect_raw


async def _until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


async def test_tcp_unregister_cuts_a_write_in_progress_and_nothing_lands_after(
    tcp_pair,
) -> None:
    _, b = tcp_pair
    dst = bytearray(8192)
    d_dst = b.register(dst)
    region = b._regions.get(d_dst.region_id)
    sock = connect_raw(d_dst.endpoint)
    header = pack_request(
        KIND_WRITE,
        1,
        0,
        1,
        region_id=d_dst.region_id,
        offset=0,
        length=4096,
        token=d_dst.token_bytes,
    )
    sock.sendall(header + b"\x22" * 100)  # admitted, then the peer stalls mid-payload
    await _until(lambda: bool(region.users) and dst[99] == 0x22)
    with structlog.testing.capture_logs() as logs:
        b.unregister(d_dst)  # returns only once the op is cut off
        assert not region.users and not region.live
        with contextlib.suppress(OSError):  # the late rest of the payload
            sock.sendall(b"\x33" * 3996)
        await asyncio.sleep(0.05)
    sock.close()
    assert dst[:100] == b"\x22" * 100  # what landed before unregister
    assert dst[100:] == bytes(8192 - 100)  # nothing after it
    cut = [e for e in logs if e["event"] == "transfer peer disconnected mid-payload"]
    assert cut and cut[0]["unregistered"] is True


async def test_tcp_op_admitted_after_unregister_is_refused(tcp_pair) -> None:
    _, b = tcp_pair
    dst = bytearray(64)
    d_dst = b.register(dst)
    b.unregister(d_dst)
    sock = connect_raw(d_dst.endpoint)
    sock.sendall(
        pack_request(
            KIND_WRITE,
            1,
            0,
            1,
            region_id=d_dst.region_id,
            offset=0,
            length=16,
            token=d_dst.token_bytes,
        )
        + b"\x44" * 16
    )
    answer = await asyncio.to_thread(sock.recv, RESPONSE.size)
    sock.close()
    assert RESPONSE.unpack(answer)[2] == KIND_ERR
    assert dst == bytes(64)


async def test_tcp_unregister_of_an_idle_region_leaves_other_connections_serving(
    tcp_pair,
) -> None:
    a, b = tcp_pair
    one, two = bytearray(64), bytearray(64)
    d_one, d_two = b.register(one), b.register(two)
    d_src = a.register(bytearray(b"s" * 64))
    await a.write(d_src, d_one, [(0, 0, 64)])
    b.unregister(d_one)  # nothing in flight: no connection is cut
    await a.write(d_src, d_two, [(0, 0, 64)])
    assert one == b"s" * 64 and two == b"s" * 64


def test_shm_clear_waits_for_a_peer_pin_and_pins_after_it_are_refused(tmp_path) -> None:
    owner = Segment.create(str(tmp_path), 1 << 16)
    peer = Segment.attach(str(tmp_path), owner.name)
    try:
        slot = owner.put(7, 0, 4096, b"t" * 16)
        pinned = peer.pin(7)
        assert pinned is not None and pinned[0] == slot
        assert peer.pin(7) is not None  # a second batch of the same peer
        result: list[bool] = []
        fence = threading.Thread(target=lambda: result.append(owner.clear(slot)))
        fence.start()
        fence.join(0.1)
        assert fence.is_alive()  # the owner waits while a peer's batch has the slot
        assert peer.pin(7) is None  # cleared: no new batch starts
        peer.unpin(slot)
        fence.join(0.1)
        assert fence.is_alive()  # one batch still copying
        peer.unpin(slot)
        fence.join(5)
        assert result == [True]
        assert owner.clear(slot, timeout_s=0.0) is True  # nothing pinned: at once
    finally:
        peer.close()
        owner.close()


def test_shm_clear_gives_up_after_its_timeout_when_a_peer_never_finishes(tmp_path) -> None:
    owner = Segment.create(str(tmp_path), 1 << 16)
    peer = Segment.attach(str(tmp_path), owner.name)
    try:
        slot = owner.put(9, 0, 64, b"t" * 16)
        assert peer.pin(9) is not None
        assert owner.clear(slot, timeout_s=0.05) is False
    finally:
        peer.close()
        owner.close()


async def test_shm_unregister_waits_for_a_peer_batch_still_copying(shm_pair) -> None:
    a, b = shm_pair
    src, dst = a.allocate(4096), b.allocate(4096)
    d_src, d_dst = a.register(src), b.register(dst)
    await a.write(d_src, d_dst, [(0, 0, 16)])  # a has mapped b's segment
    segment = a._segment(d_dst)
    slot = segment.pin(d_dst.region_id)[0]  # what a batch holds while it copies
    unregistered = threading.Event()
    fence = threading.Thread(target=lambda: (b.unregister(d_dst), unregistered.set()))
    fence.start()
    assert not unregistered.wait(0.1)  # b waits for the batch
    segment.unpin(slot)  # the batch's copy ended
    assert unregistered.wait(5)
    fence.join(5)
    with pytest.raises(TransferError, match="refused"):
        await a.write(d_src, d_dst, [(0, 0, 16)])


def test_tcp_cut_from_a_stale_user_list_spares_the_connection_s_op_on_another_region() -> None:
    from libs.common.transfer.region import RegionTable
    from libs.common.transfer.tcp.fence import OpFence

    table = RegionTable()
    one, two = table.add(bytearray(64)), table.add(bytearray(64))
    left, right = socket.socketpair()
    fence = OpFence(left)
    try:
        fence.start(two.region_id)  # the connection has moved on to region two
        fence(one)  # a cut for region one, from a list taken before it left
        left.sendall(b"still up")
        assert right.recv(8) == b"still up"
        fence(two)  # region two going away does cut it
        assert right.recv(8) == b""  # shut down
    finally:
        fence.close()
        right.close()


async def test_shm_unregister_on_the_writer_s_own_loop_waits_only_for_the_copies(
    shm_pair,
) -> None:
    # Owner and writer share one event loop: the pin must end with the copy threads,
    # since the loop is held by unregister until then.
    a, b = shm_pair  # inline_copy_bytes 64 KiB: 32 MiB goes to the copy threads
    size = 32 << 20
    src, dst = a.allocate(size), b.allocate(size)
    src[:] = b"\x5a" * size
    d_src, d_dst = a.register(src), b.register(dst)
    await a.write(d_src, d_dst, [(0, 0, 16)])  # a has mapped b's segment
    writing = asyncio.ensure_future(a.write(d_src, d_dst, [(0, 0, size)]))
    await asyncio.sleep(0)  # the batch pinned the slot and started its copies
    with structlog.testing.capture_logs() as logs:
        b.unregister(d_dst)
    assert dst == b"\x5a" * size  # every byte landed before unregister returned
    assert not [e for e in logs if e["log_level"] == "error"]
    await writing


async def test_tcp_unregister_raises_region_busy_when_an_op_will_not_leave(
    tcp_pair, monkeypatch
) -> None:
    from libs.common.transfer import region as region_module

    monkeypatch.setattr(region_module, "_DRAIN_TIMEOUT_S", 0.05)
    _, b = tcp_pair
    d_dst = b.register(bytearray(64))
    stuck = b._regions.get(d_dst.region_id)
    stuck.users.add(lambda region: None)  # an op whose cut does not stop it
    with pytest.raises(RegionBusy):
        b.unregister(d_dst)
    assert b._regions.get(d_dst.region_id) is None  # gone all the same


async def test_shm_unregister_raises_region_busy_when_a_peer_copy_never_ends(
    shm_pair, monkeypatch
) -> None:
    from libs.common.transfer.shm import segment as shm_segment

    monkeypatch.setattr(shm_segment, "FENCE_TIMEOUT_S", 0.05)
    a, b = shm_pair
    src, dst = a.allocate(4096), b.allocate(4096)
    d_src, d_dst = a.register(src), b.register(dst)
    await a.write(d_src, d_dst, [(0, 0, 16)])
    a._segment(d_dst).pin(d_dst.region_id)  # a peer frozen mid-copy
    with pytest.raises(RegionBusy):
        b.unregister(d_dst)
    with pytest.raises(TransferError, match="unknown region"):
        await a.write(d_src, d_dst, [(0, 0, 16)])


async def test_tcp_a_batch_queued_behind_a_cut_one_is_sent_again_and_lands() -> None:
    # One connection: a large write into region A is mid-payload when A is unregistered
    # (its connection is cut); a small write into B, queued behind it on the same
    # connection, must not fail with it.
    a = TcpTransferEngine(connections_per_peer=1, batch_timeout_s=30.0)
    b = TcpTransferEngine()
    async with a, b:
        size = 48 << 20
        src = a.register(a.allocate(size))
        region_a, region_b = bytearray(size), bytearray(4096)
        d_a, d_b = b.register(region_a), b.register(region_b)
        await a.write(src, d_b, [(0, 0, 16)])  # connected
        served = b._regions.get(d_a.region_id)
        big = asyncio.ensure_future(a.write(src, d_a, [(0, 0, size)]))
        await _until(lambda: bool(served.users))  # A's payload is arriving
        small = asyncio.ensure_future(a.write(src, d_b, [(4096 - 64, 0, 64)]))
        await asyncio.sleep(0)
        with structlog.testing.capture_logs() as logs:
            b.unregister(d_a)
            results = await asyncio.gather(big, small, return_exceptions=True)
        assert isinstance(results[0], TransferError)  # cut, then refused: A is gone
        assert results[1] is None  # B's batch was sent again and landed
        assert any(e["event"] == "transfer batch sent again on a fresh connection"
                   for e in logs)  # fmt: skip
