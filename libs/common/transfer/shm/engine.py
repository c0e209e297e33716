"""The shared-memory transport: peers on one host, a memcpy between mappings.

Regions must live in a segment made by `allocate()` (see shm_segment for the layout
and the region table). A write or read maps the peer's segment once (cached until
`stop`), checks the region id, the token (constant time) and the bounds against the
owner's slot, then copies with `ctypes.memmove`, which releases the GIL. Batches under
`inline_copy_bytes` (default 2 MiB) are copied inline: a thread hand-off costs more
than such a copy blocks the loop. Larger batches are copied on `copy_threads` worker
threads, so the event loop stays free and both cores copy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import hmac
import itertools
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from libs.common.transfer.descriptor import RegionDescriptor
from libs.common.transfer.engine import EngineState, TransferEngine
from libs.common.transfer.errors import AccessRefused, RegionBusy, TransferError
from libs.common.transfer.ops import Op, Slice, check_range, plain, slice_ops, spread
from libs.common.transfer.region import Region
from libs.common.transfer.shm.segment import Segment


def host_id() -> str:
    """Same value in every process of one host (and container sharing its kernel)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def _copy(pairs: list[tuple[int, int, int]]) -> None:
    for dst, src, n in pairs:
        ctypes.memmove(dst, src, n)


class ShmTransferEngine(TransferEngine):
    """Transfer engine over POSIX shared memory; see the module docstring."""

    transport = "shm"

    def __init__(
        self,
        *,
        shm_dir: str = "/dev/shm",
        copy_threads: int = 2,
        slice_bytes: int = 4 << 20,
        inline_copy_bytes: int = 2 << 20,
    ) -> None:
        super().__init__()
        if copy_threads < 1:
            raise ValueError(f"copy_threads: must be >= 1, got {copy_threads}")
        if slice_bytes <= 0:
            raise ValueError(f"slice_bytes: must be positive, got {slice_bytes}")
        if inline_copy_bytes < 0:
            raise ValueError(f"inline_copy_bytes: must be >= 0, got {inline_copy_bytes}")
        if not Path(shm_dir).is_dir():
            raise ValueError(f"shm_dir: {shm_dir} is not a directory")
        self._dir = shm_dir
        self._threads = copy_threads
        self._slice_bytes = slice_bytes
        self._inline = inline_copy_bytes
        self._host = host_id()
        self._owned: dict[str, Segment] = {}
        self._attached: dict[str, Segment] = {}
        self._pool: ThreadPoolExecutor | None = None

    @property
    def endpoint(self) -> str:
        return f"{self._host}:{self._dir}"

    def info(self) -> dict[str, object]:
        out = super().info()
        out.update(segments=len(self._owned), copy_threads=self._threads)
        return out

    def allocate(self, nbytes: int) -> memoryview:
        """A new shared segment of `nbytes`; only such memory can be registered."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes: must be a positive integer, got {nbytes!r}")
        if self._state in (EngineState.STOPPING, EngineState.STOPPED):
            raise RuntimeError(f"allocate: engine is {self._state.value}")
        segment = Segment.create(self._dir, nbytes)
        self._owned[segment.name] = segment
        return segment.new_view()

    async def _start(self) -> None:
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="tandem-shm-copy")

    async def _stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for segment in [*self._attached.values(), *self._owned.values()]:
            segment.close()
        self._attached.clear()
        self._owned.clear()

    def _on_register(self, region: Region) -> None:
        for segment in self._owned.values():
            offset = region.addr - segment.data_addr
            if check_range(offset, region.length, segment.data_len):
                slot = segment.put(region.region_id, offset, region.length, region.token)
                region.extra.update(segment=segment, slot=slot, offset=offset)
                return
        raise ValueError("buffer: the shm transport registers only memory from allocate()")

    def _on_unregister(self, region: Region) -> None:
        if not region.extra["segment"].clear(region.extra["slot"]):
            self._log.error("unregister: a peer's copy into the region did not end in time",
                            region_id=region.region_id)  # fmt: skip
            raise RegionBusy(f"region {region.region_id}: a peer's copy did not end in time")

    def _descriptor(self, region: Region) -> RegionDescriptor:
        segment: Segment = region.extra["segment"]
        return RegionDescriptor(
            "shm",
            f"{self._host}:{segment.name}",
            region.region_id,
            region.length,
            region.token.hex(),
            addr=region.extra["offset"],
        )

    async def _attach(self, host: str, name: str) -> None:
        """Map a peer's segment the first time it is addressed, in a thread: mapping a
        store's segment fills its page tables (Segment.attach), tens of ms per GiB,
        which must not hold the event loop. Failures are left to `_segment`."""
        if host != self._host:
            return
        try:
            segment = await asyncio.to_thread(Segment.attach, self._dir, name)
        except (OSError, ValueError):
            return
        if name in self._attached or self._state is not EngineState.RUNNING:
            segment.close()  # another batch mapped it meanwhile, or the engine stopped
        else:
            self._attached[name] = segment

    def _segment(self, remote: RegionDescriptor) -> Segment:
        host, _, name = remote.endpoint.partition(":")
        if host != self._host:
            raise AccessRefused("region lives on another host (shm needs the same host)")
        segment = self._owned.get(name) or self._attached.get(name)
        if segment is None:
            try:
                segment = Segment.attach(self._dir, name)
            except (OSError, ValueError) as exc:
                raise AccessRefused(f"cannot map segment: {exc}") from None
            self._attached[name] = segment
        return segment

    def _pin(self, remote: RegionDescriptor) -> tuple[Segment, int, int]:
        """The owner's slot must match the descriptor; pins it (Segment.pin: the
        owner's unregister waits for the batch) and returns (segment, slot, address)."""
        segment = self._segment(remote)
        found = segment.pin(remote.region_id)
        index, offset, length, token = found if found is not None else (-1, 0, 0, bytes(16))
        token_ok = hmac.compare_digest(token, remote.token_bytes)
        try:
            if found is None:
                raise AccessRefused(f"unknown region {remote.region_id}")
            if not token_ok:
                raise AccessRefused(f"wrong token for region {remote.region_id}")
            if offset != remote.addr or length != remote.length:
                raise AccessRefused(f"descriptor does not match region {remote.region_id}")
            if not check_range(offset, length, segment.data_len):
                raise AccessRefused(f"region {remote.region_id} exceeds its segment")
        except AccessRefused:
            if found is not None:
                segment.unpin(index)
            raise
        return segment, index, segment.data_addr + offset

    async def _transfer(
        self, kind: str, region: Region, remote: RegionDescriptor, ops: list[Op]
    ) -> None:
        host, _, name = remote.endpoint.partition(":")
        if name not in self._attached and name not in self._owned:  # no coroutine once mapped
            await self._attach(host, name)
        try:
            segment, slot, remote_addr = self._pin(remote)
        except AccessRefused as exc:
            # The region as a whole is refused, so the batch's first op is.
            self._log.warning("transfer refused", peer=remote.endpoint, reason=exc.reason,
                              kind=kind, op_index=0)  # fmt: skip
            raise TransferError(
                remote.endpoint, f"refused: {exc.reason}", 0, plain(ops[0])
            ) from None
        try:
            copies = self._move(kind, region, remote_addr, ops)
        except BaseException:
            segment.unpin(slot)
            raise
        if not copies:
            segment.unpin(slot)
            return
        # The pin ends with the batch's last copy, in that copy's thread: the owner's
        # unregister then waits for the bytes, not for this event loop to come round
        # (nor for a cancelled batch's copies, which run on in their threads).
        ended = itertools.count(1)

        def copied(_: concurrent.futures.Future[None]) -> None:
            if next(ended) == len(copies):  # itertools.count is atomic under the GIL
                segment.unpin(slot)

        for copy in copies:
            copy.add_done_callback(copied)
        await asyncio.gather(*(asyncio.wrap_future(c) for c in copies))

    def _move(
        self, kind: str, region: Region, remote_addr: int, ops: list[Op]
    ) -> list[concurrent.futures.Future[None]]:
        """Copy a small batch inline (returns []), or start a large one on the copy
        threads (returns their futures)."""
        # Bounds were validated against the descriptor, and the descriptor against
        # the owner's slot, so every address below lies inside the peer's region.
        if len(ops) == 1 and (ops[0].length < self._inline or self._pool is None):
            local_off, remote_off, length = ops[0]  # the usual batch: one copy, inline
            local, remote = region.addr + local_off, remote_addr + remote_off
            if kind == "write":
                ctypes.memmove(remote, local, length)
            else:
                ctypes.memmove(local, remote, length)
            return []
        slices = slice_ops(ops, self._slice_bytes)
        total = sum(s.length for s in slices)

        def pairs(lane: list[Slice]) -> list[tuple[int, int, int]]:
            if kind == "write":
                return [(remote_addr + s.remote_off, region.addr + s.local_off, s.length)
                        for s in lane]  # fmt: skip
            return [(region.addr + s.local_off, remote_addr + s.remote_off, s.length) for s in lane]

        if total < self._inline or self._pool is None:
            _copy(pairs(slices))
            return []
        lanes = [lane for lane in spread(slices, self._threads) if lane]
        return [self._pool.submit(_copy, pairs(ln)) for ln in lanes]
