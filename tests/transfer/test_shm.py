"""shm transport: same-host memcpy between segments, with the owner's checks."""

from __future__ import annotations

import asyncio
import os

import pytest
import structlog
import torch

from libs.common.transfer import TransferError
from libs.common.transfer.descriptor import RegionDescriptor
from libs.common.transfer.shm.engine import ShmTransferEngine


async def test_write_and_read_through_shared_memory(shm_pair) -> None:
    a, b = shm_pair
    src_mem, dst_mem = a.allocate(1 << 20), b.allocate(1 << 20)
    payload = os.urandom(1 << 20)
    src_mem[:] = payload
    d_src, d_dst = a.register(src_mem), b.register(dst_mem)
    await a.write(d_src, d_dst, [(0, 4096, 100), (100, 0, 4096)])  # inline copy
    assert dst_mem[4096:4196] == payload[:100] and dst_mem[:4096] == payload[100:4196]
    await a.write(d_src, d_dst, [(0, 0, 1 << 20)])  # threaded copy
    assert dst_mem == payload
    src_mem[:] = bytes(1 << 20)
    await a.read(d_src, d_dst, [(0, 0, 1 << 20)])
    assert src_mem == payload


async def test_kv_pool_tensor_allocated_through_the_engine_is_registrable(shm_pair) -> None:
    a, b = shm_pair
    pool = torch.frombuffer(b.allocate(4 * 2 * 16 * 8 * 4), dtype=torch.float32)
    pool = pool.view(4, 2, 16, 8)  # pages x (k, v) x tokens x dims
    page = pool[2]  # register one page: a sub-range of the segment
    d_page = b.register(page)
    assert d_page.addr == 2 * page.numel() * 4
    src = torch.frombuffer(a.allocate(page.numel() * 4), dtype=torch.float32)
    src.copy_(torch.arange(page.numel(), dtype=torch.float32))
    await a.write(a.register(src), d_page, [(0, 0, page.numel() * 4)])
    assert torch.equal(pool[2].flatten(), src) and pool[1].abs().sum() == 0


async def test_refusals_touch_nothing(shm_pair) -> None:
    a, b = shm_pair
    dst_mem = b.allocate(8192)
    region = dst_mem[:4096]
    src = a.allocate(8192)
    src[:] = b"q" * 8192
    d_src, d_dst = a.register(src), b.register(region)
    forged = {
        "wrong token": {"token": "00" * 16},
        "unknown region": {"region_id": d_dst.region_id ^ 1},
        "does not match": {"length": 8192},
        "another host": {"endpoint": "other-host:" + d_dst.endpoint.split(":", 1)[1]},
        "cannot map": {"endpoint": d_dst.endpoint.split(":", 1)[0] + ":../../etc/passwd"},
    }
    with structlog.testing.capture_logs() as logs:
        for reason, change in forged.items():
            desc = RegionDescriptor.from_dict({**d_dst.to_dict(), **change})
            with pytest.raises(TransferError, match=reason) as info:
                await a.write(d_src, desc, [(0, 0, 16)])
            assert info.value.peer == desc.endpoint and info.value.op == (0, 0, 16)
    refused = [e for e in logs if e["event"] == "transfer refused"]
    assert len(refused) == len(forged) and all("token" not in e for e in refused)
    b.unregister(d_dst)
    with pytest.raises(TransferError, match="unknown region"):
        await a.write(d_src, d_dst, [(0, 0, 16)])
    assert dst_mem == bytes(8192)


async def test_only_engine_allocated_memory_can_be_registered(shm_pair) -> None:
    a, _ = shm_pair
    with pytest.raises(ValueError, match="allocate"):
        a.register(bytearray(4096))
    with pytest.raises(ValueError, match="nbytes"):
        a.allocate(0)


async def test_stop_unlinks_segments_but_live_views_stay_valid(tmp_path) -> None:
    engine = ShmTransferEngine(shm_dir=str(tmp_path))
    await engine.start()
    view = engine.allocate(4096)
    engine.register(view)
    assert len(os.listdir(tmp_path)) == 1
    await engine.stop()
    await engine.stop()
    assert os.listdir(tmp_path) == []
    view[:4] = b"ok!!"  # the mapping lives as long as the view
    assert view[:4] == b"ok!!"


async def test_concurrent_shm_batches(shm_pair) -> None:
    a, b = shm_pair
    src, dst = a.allocate(32 << 20), b.allocate(32 << 20)
    src[:] = os.urandom(1 << 20) * 32
    d_src, d_dst = a.register(src), b.register(dst)
    ops = [[(i << 20, i << 20, 1 << 20)] for i in range(32)]
    async with asyncio.timeout(20):
        await asyncio.gather(*(a.write(d_src, d_dst, o) for o in ops))
    assert dst == src


async def test_one_buffer_registered_1023_times_each_fenced_alone(shm_pair) -> None:
    """A decode worker registers its KV pool once per handoff in flight: 1023 at once work,
    the next is refused (the worker waits), and an unregistered one refuses writes while
    every other registration still takes them."""
    from libs.common.transfer.shm.segment import NSLOTS

    a, b = shm_pair
    src = a.register(a.allocate(4096))
    pool = b.allocate(1 << 16)
    regions = [b.register(pool) for _ in range(NSLOTS)]
    assert NSLOTS == 1023 and len({r.region_id for r in regions}) == NSLOTS
    with pytest.raises(ValueError, match="1023 regions"):
        b.register(pool)
    await a.write(src, regions[500], [(0, 0, 16)])  # the writer now knows its slot
    b.unregister(regions[500])
    with pytest.raises(TransferError, match="unknown region"):
        await a.write(src, regions[500], [(0, 0, 16)])
    await a.write(src, regions[-1], [(0, 0, 16)])  # the last slot is found
    assert b.register(pool).region_id not in {r.region_id for r in regions}  # slot reused
    with pytest.raises(TransferError, match="unknown region"):  # the slot's new tenant
        await a.write(src, regions[500], [(0, 0, 16)])


async def test_a_peer_maps_a_full_segment_populated_and_never_allocates_a_sparse_one(
    tmp_path,
) -> None:
    # A peer attaching a segment whose owner holds every page (a store prefaults its
    # own) fills its page tables at once; one with holes must stay as sparse as the
    # owner left it (populating would allocate the owner's untouched memory).
    from libs.common.transfer.shm import segment as shm_segment

    assert shm_segment._attach_flags(True) & getattr(shm_segment.mmap, "MAP_POPULATE", 0)
    assert not shm_segment._attach_flags(False) & getattr(shm_segment.mmap, "MAP_POPULATE", 1)
    a, b = ShmTransferEngine(shm_dir=str(tmp_path)), ShmTransferEngine(shm_dir=str(tmp_path))
    async with a, b:
        full, sparse = b.allocate(4 << 20), b.allocate(64 << 20)
        full[:] = bytes(4 << 20)  # every page of `full` is the owner's now
        d_full, d_sparse = b.register(full), b.register(sparse)
        src = a.allocate(1 << 20)
        src[:] = os.urandom(1 << 20)
        d_src = a.register(src)
        files = {p.name: p for p in tmp_path.iterdir()}
        used_before = {n: p.stat().st_blocks for n, p in files.items()}
        await asyncio.gather(  # concurrent first batches map each segment once
            a.write(d_src, d_full, [(0, 1 << 20, 1 << 20)]),
            a.write(d_src, d_full, [(0, 2 << 20, 1 << 20)]),
            a.write(d_src, d_sparse, [(0, 8 << 20, 4096)]),
        )
        assert full[1 << 20 : 2 << 20] == src and full[2 << 20 : 3 << 20] == src
        assert sparse[8 << 20 : (8 << 20) + 4096] == src[:4096]
        assert a.info()["segments"] == 1 and len(a._attached) == 2
        sparse_name = d_sparse.endpoint.partition(":")[2]
        # The sparse segment grew by the one page written, not by its 64 MiB.
        grown = (files[sparse_name].stat().st_blocks - used_before[sparse_name]) * 512
        assert 0 < grown <= 64 << 10
