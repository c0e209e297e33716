"""The SSD tier's faults, on a real nats-server, master and store: a promotion that answers
after the master gave up never lands in a range handed out again, and a full disk degrades
the tier to DRAM only (no .tmp left, nothing lost from DRAM) until space returns.

The slow disk is a named pipe in place of an object's file: the store's read of it waits
until the test writes the file's bytes into it. The full disk is a small tmpfs mounted on
the tier's directory (root only: skipped, saying so, where mount is not permitted).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import subprocess
import time

import pytest

from libs.common.messages.control import InfoRequest, ServiceInfo
from tests.pool.test_pool_ssd import (
    COUNT,
    MASTER,
    SIZE,
    _ssd_tiers,
    _until,
    put_one_by_one,
    read_back,
    spills_settled,
    ssd_file,
    ssd_pool,
)


async def reader_waiting(path) -> int:
    """The write end of the named pipe at `path`, once the store has opened it to read
    (ENXIO before that); bounded in time."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.05)


def feed(fd: int, data: bytes) -> None:
    """Write `data` into a named pipe's write end and close it: the reader gets the bytes,
    then the end of the file."""
    try:
        os.set_blocking(fd, True)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def stall(path) -> bytes:
    """Put a named pipe in place of the file at `path` (its bytes returned): the store's
    read of it waits for the test, as on a disk that has stalled."""
    content = path.read_bytes()
    path.unlink()
    os.mkfifo(path)
    return content


async def test_a_late_promotion_never_writes_into_a_range_handed_out_again(pool_procs,
                                                                           nats_url,
                                                                           tmp_path):  # fmt: skip
    async with ssd_pool(pool_procs, nats_url, tmp_path) as h:
        keys = [f"late-{i:02d}" for i in range(COUNT)]
        blobs = await put_one_by_one(h, keys)
        await _until(lambda: spills_settled(h, keys), "the spills settle")
        only = [k for k in keys if ssd_file(h, k).exists()][:3]  # the oldest: SSD only
        assert await h.client.batch_exists(only) == 3
        victim, other, third = only
        path = ssd_file(h, victim)
        content = stall(path)
        started = time.monotonic()
        (res,) = await h.client.batch_get([victim], h.mem, [h.half], SIZE)
        assert not res.ok and time.monotonic() - started >= 4.5, "the promotion timed out"
        assert (await h.client.stats()).ssd["stranded"] == 1  # its range is held
        started = time.monotonic()  # the store is busy with it: no promotion queues behind
        (res,) = await h.client.batch_get([third], h.mem, [h.half], SIZE)
        assert not res.ok and time.monotonic() - started < 2.5
        assert (await h.client.stats()).ssd["stranded"] == 1
        fresh = [f"fresh-{i:02d}" for i in range(8)]  # free ranges are handed out again
        fresh_blobs = await put_one_by_one(h, fresh)
        await asyncio.to_thread(feed, await reader_waiting(path), content)  # late
        # The store serves its orders one at a time: a removal's answer comes after the
        # late promotion has copied (or not) its bytes into the segment.
        assert await h.client.remove([other]) == 1
        await _until(_no_stranded(h), "the fence freed the held range")
        got = await read_back(h, fresh)
        assert got == fresh_blobs  # bytes equal and MAC verified: none was overwritten
        tmp = path.with_name(path.name + ".new")
        tmp.write_bytes(content)
        os.replace(tmp, path)  # the disk is well again: the entry was never lost
        assert await read_back(h, [victim, third]) == {k: blobs[k] for k in (victim, third)}


async def test_a_promotion_late_across_a_new_master_writes_nothing(pool_procs, nats_url,
                                                                    tmp_path):  # fmt: skip
    """The master that ordered it is gone (kill -9); the new one knows nothing of the
    promotion's range and hands it out: the store, mounted again since the order, must
    not copy the late read into its segment."""
    async with ssd_pool(pool_procs, nats_url, tmp_path) as h:
        keys = [f"gone-{i:02d}" for i in range(COUNT)]
        await put_one_by_one(h, keys)
        await _until(lambda: spills_settled(h, keys), "the spills settle")
        victim, other = [k for k in keys if ssd_file(h, k).exists()][:2]
        path = ssd_file(h, victim)
        content = stall(path)
        get = asyncio.create_task(h.client.batch_get([victim], h.mem, [h.half], SIZE))
        fd = await reader_waiting(path)  # the store is reading it for the promotion
        pool_procs.kill("master")
        pool_procs.master(*MASTER)
        with contextlib.suppress(Exception):  # its master is gone: an error or a miss
            await get
        await h.wait_stores(1)
        await _until(lambda: _ssd_tiers(h), "the store mounted and reported to the new master")
        fresh = [f"fresh-{i:02d}" for i in range(8)]
        fresh_blobs = await put_one_by_one(h, fresh)
        await asyncio.to_thread(feed, fd, content)
        assert await h.client.remove([other]) == 1  # answered after the late promotion
        assert await read_back(h, fresh) == fresh_blobs
        assert "ssd promotion not written" in pool_procs.log("s1")


def _no_stranded(h):
    async def check() -> bool:
        return (await h.client.stats()).ssd["stranded"] == 0

    return check


@contextlib.contextmanager
def small_disk(path, size: str):
    """A tmpfs of `size` mounted on `path` (unmounted after)."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"no small filesystem for the full-disk test: mount failed ({e})")
    if done.returncode != 0:
        pytest.skip(f"no small filesystem for the full-disk test (needs root): "
                    f"{done.stderr.strip()}")  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10)


async def store_info(h) -> dict:
    reply = await h.bus.request("tandem.cache_store.s1.info", InfoRequest(), ServiceInfo)
    return reply.details


async def test_a_full_disk_degrades_the_tier_to_dram_only_and_it_resumes_with_space(
    pool_procs, nats_url, tmp_path
):
    with small_disk(tmp_path / "ssd", "2m") as disk:
        filler = disk / "filler"  # leaves room for 3 objects' files (17 pages each)
        filler.write_bytes(b"\0" * ((2 << 20) - 3 * 17 * 4096 - 2048))
        async with ssd_pool(pool_procs, nats_url, tmp_path, "--ssd-retry-interval", "4") as h:
            keys = [f"full-{i:02d}" for i in range(COUNT)]
            blobs = await put_one_by_one(h, keys)
            info = await store_info(h)
            assert info["ssd_write_errors"] >= 1 and info["ssd_objects"] == 3
            assert info["ssd_degraded_s"] > 0 or info["ssd_write_errors"] > 1
            assert not list(disk.glob("*.tmp")), "a failed write left its .tmp file"
            assert pool_procs.log("s1").count("ssd tier degraded") == 1  # logged once
            on_disk = [k for k in keys if ssd_file(h, k).exists()]
            assert len(on_disk) == 3
            present = [k for k in keys if await h.client.batch_exists([k]) == 1]
            in_dram = [k for k in present if k not in on_disk]
            # DRAM kept what a DRAM-only pool keeps: the newest, down to the low watermark
            assert len(in_dram) >= 12 and in_dram == keys[-len(in_dram) :]
            assert await read_back(h, in_dram) == {k: blobs[k] for k in in_dram}
            assert await read_back(h, on_disk) == {k: blobs[k] for k in on_disk}
            stats = await h.client.stats()
            assert stats.ssd["copies"] == 3  # the master lost no entry, invented none

            filler.unlink()  # space returns: after the retry interval, spills go on
            more = [f"more-{i:02d}" for i in range(8)]
            blobs |= await put_one_by_one(h, more)

            async def resumed() -> bool:
                await put_one_by_one(h, [f"kick-{time.monotonic_ns()}"])  # a spill round
                return (await h.client.stats()).ssd["copies"] > 3

            await _until(resumed, "spills go on once the disk has room", timeout=30)
            assert "ssd tier writable again" in pool_procs.log("s1")
            assert not list(disk.glob("*.tmp"))
            on_ssd = [k for k in keys + more if ssd_file(h, k).exists()]
            assert await read_back(h, on_ssd) == {k: blobs[k] for k in on_ssd}
