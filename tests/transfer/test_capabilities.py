"""Capabilities (TransferEngine.grant): a grant allows its op kind on its ranges only,
until revoked or expired; enforced by the tcp server, over real loopback sockets."""

from __future__ import annotations

import asyncio

import pytest

from libs.common.transfer import TransferError
from libs.common.transfer.region import Grant

REGION = 1 << 16


async def _owner_and_peer(tcp_pair):
    owner, peer = tcp_pair
    memory = owner.allocate(REGION)
    whole = owner.register(memory)
    src = peer.register(bytearray(b"\xab" * 4096))
    return owner, peer, memory, whole, src


async def test_a_write_grant_allows_its_ranges_and_refuses_the_rest(tcp_pair):
    owner, peer, memory, whole, src = await _owner_and_peer(tcp_pair)
    cap = owner.grant(whole, [(4096, 1024), (8192, 2048)], "write")
    await peer.write(src, cap, [(0, 4096, 1024), (0, 8192, 2048)])
    assert bytes(memory[4096:5120]) == b"\xab" * 1024
    for op in ((0, 0, 16), (0, 5120 - 8, 16), (0, 8192 + 2040, 16)):  # outside, straddling
        with pytest.raises(TransferError, match="outside the granted ranges"):
            await peer.write(src, cap, [op])
    assert bytes(memory[:4096]) == bytes(4096) and bytes(memory[5120:8192]) == bytes(3072)


async def test_a_write_grant_refuses_reads_and_a_read_grant_refuses_writes(tcp_pair):
    owner, peer, memory, whole, src = await _owner_and_peer(tcp_pair)
    memory[0:64] = b"\x11" * 64
    write_cap = owner.grant(whole, [(0, 64)], "write")
    read_cap = owner.grant(whole, [(0, 64)], "read")
    with pytest.raises(TransferError, match="grant is write-only"):
        await peer.read(src, write_cap, [(0, 0, 64)])
    with pytest.raises(TransferError, match="grant is read-only"):
        await peer.write(src, read_cap, [(0, 0, 64)])
    assert bytes(memory[0:64]) == b"\x11" * 64
    await peer.read(src, read_cap, [(100, 0, 64)])


async def test_a_revoked_or_expired_grant_is_refused_and_the_region_is_not(tcp_pair):
    owner, peer, _, whole, src = await _owner_and_peer(tcp_pair)
    revoked = owner.grant(whole, [(0, 64)], "write")
    expiring = owner.grant(whole, [(0, 64)], "write", ttl_s=0.2)
    await peer.write(src, expiring, [(0, 0, 64)])
    owner.revoke(revoked)
    with pytest.raises(TransferError, match="unknown region or wrong token"):
        await peer.write(src, revoked, [(0, 0, 64)])
    await asyncio.sleep(0.3)
    with pytest.raises(TransferError, match="grant expired"):
        await peer.write(src, expiring, [(0, 0, 64)])
    assert owner.revoke_expired() == 1
    await peer.write(src, whole, [(0, 0, 64)])  # the whole region's own descriptor still works


def test_grants_are_built_sorted_and_merged_and_bad_ones_refused():
    g = Grant.build([(100, 10), (0, 50), (50, 10), (105, 20)], "read", 1000, 1e9)
    assert (g.starts, g.ends) == ((0, 100), (60, 125))
    assert g.refusal("read", 0, 60, 0) is None and g.refusal("read", 55, 10, 0) is not None
    assert Grant.build([], "write", 1000, 1e9).refusal("write", 0, 1, 0) is not None
    for ranges, mode in (([(0, 0)], "read"), ([(990, 20)], "read"), ([(0, 8)], "exec")):
        with pytest.raises(ValueError):
            Grant.build(ranges, mode, 1000, 1e9)


async def test_an_shm_grant_is_its_own_slot_and_a_revoked_one_is_refused(shm_pair):
    # shm peers copy themselves: ranges and mode are checked by their code, not enforced
    # (docs/transfer.md); what the owner does enforce is the id, token and revocation.
    owner, peer = shm_pair
    memory = owner.allocate(REGION)
    whole = owner.register(memory)
    src = peer.register(peer.allocate(4096))
    cap = owner.grant(whole, [(0, 4096)], "write")
    assert cap.region_id != whole.region_id and cap.token != whole.token
    await peer.write(src, cap, [(0, 0, 4096)])
    owner.revoke(cap)
    with pytest.raises(TransferError):
        await peer.write(src, cap, [(0, 0, 64)])
