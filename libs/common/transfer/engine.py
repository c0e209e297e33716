"""The transfer engine interface, shared by every transport (tcp, shm, rdma).

    engine = create_engine("tcp", host="127.0.0.1")
    await engine.start()                       # logs transport + endpoint
    pool = engine.allocate(64 << 20)           # memory the transport can serve
    desc = engine.register(pool)               # -> RegionDescriptor (send it to peers)
    await engine.write(desc, remote_desc, [(local_off, remote_off, length), ...])
    await engine.read(desc, remote_desc, ops)  # remote -> local
    engine.unregister(desc)
    await engine.stop()                        # idempotent, safe on a half-started engine

State machine (methods other than start/stop need RUNNING):

    NEW --start()--> STARTING --ok--> RUNNING --stop()--> STOPPING --> STOPPED
                        |                                     ^
                        +--failure: stop() cleans up ---------+

Contract of write/read:
  - ops are validated against both regions before anything is sent (ValueError);
  - many batches may be in flight at once from one or many tasks;
  - the awaitable completes when every byte of every op has landed, or raises
    TransferError naming the peer and the op; a failed batch may have moved some of
    its bytes, but never outside the ranges its ops address;
  - a cancelled batch may still complete on the wire; its ranges are undefined.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import math
import mmap
import time
from collections.abc import Awaitable, Sequence
from typing import Any

import structlog

from libs.common.transfer.descriptor import RegionDescriptor
from libs.common.transfer.errors import RegionBusy
from libs.common.transfer.ops import Op, validate_ops
from libs.common.transfer.region import Grant, Region, RegionTable


class EngineState(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class TransferEngine(abc.ABC):
    """Moves bytes between registered regions of this process and of peers.

    Subclasses implement `_start`, `_stop`, `_descriptor` and `_transfer`; this base
    class owns the state machine, the region table and argument validation, so every
    transport refuses the same bad input the same way.
    """

    transport: str = ""

    def __init__(self) -> None:
        self._state = EngineState.NEW
        self._regions = RegionTable()
        self._log = structlog.get_logger("tandem.transfer").bind(transport=self.transport)

    # -- lifecycle ---------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """Where peers reach this engine; meaningful once RUNNING."""

    async def start(self) -> None:
        if self._state is not EngineState.NEW:
            raise RuntimeError(f"start: engine is {self._state.value}, not new")
        self._state = EngineState.STARTING
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        self._state = EngineState.RUNNING
        self._log.info("transfer engine started", endpoint=self.endpoint)

    async def stop(self) -> None:
        if self._state in (EngineState.STOPPING, EngineState.STOPPED):
            return
        started = self._state is not EngineState.NEW
        self._state = EngineState.STOPPING
        try:
            if started:
                await self._stop()
        finally:
            for region in self._regions.all():
                with contextlib.suppress(RegionBusy):  # logged; the process is leaving it
                    self._regions.remove(region.region_id)
            self._state = EngineState.STOPPED
            if started:
                self._log.info("transfer engine stopped")

    async def __aenter__(self) -> TransferEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def info(self) -> dict[str, Any]:
        """What a service shows in its `info` so operators see the active transport."""
        return {
            "transport": self.transport,
            "endpoint": self.endpoint if self._state is EngineState.RUNNING else None,
            "state": self._state.value,
            "regions": len(self._regions),
        }

    # -- memory --------------------------------------------------------------------

    def allocate(self, nbytes: int) -> memoryview:
        """Memory this transport can register (page-aligned, zeroed).

        Allocate KV pools through this: shm needs them in a shared segment, rdma wants
        page-aligned memory. Wrap with `torch.frombuffer(view, dtype=...)` or
        `numpy.frombuffer`. The memory lives as long as any view of it.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes: must be a positive integer, got {nbytes!r}")
        return memoryview(mmap.mmap(-1, nbytes))

    def register(self, buffer: Any, *, grant: Grant | None = None) -> RegionDescriptor:
        self._require_running("register")
        region = self._regions.add(buffer, grant)
        try:
            self._on_register(region)
        except BaseException:
            self._regions.remove(region.region_id)
            raise
        return self._descriptor(region)

    def grant(
        self, region: RegionDescriptor | int, ranges: Sequence[tuple[int, int]], mode: str,
        ttl_s: float | None = None,
    ) -> RegionDescriptor:  # fmt: skip
        """A capability on part of a registered region: a descriptor of its own id and
        token that allows only ops of `mode` ("read", "write" or "rw") inside the
        (offset, length) `ranges` (offsets of the region), until `revoke` or `ttl_s`.

        Where it is enforced (docs/transfer.md, "Capabilities"): the tcp server checks
        every op against it; shm gives it its own slot, so revoking it fences its users,
        but ranges and mode are checked by the peer's own code only; rdma cannot narrow
        an rkey here (ValueError)."""
        self._require_running("grant")
        region_id = region.region_id if isinstance(region, RegionDescriptor) else region
        parent = self._regions.get(region_id)
        if parent is None:
            raise ValueError(f"region: {region_id} is not registered with this engine")
        expires = math.inf if ttl_s is None else time.monotonic() + ttl_s
        built = Grant.build(ranges, mode, parent.length, expires)
        return self.register(parent.view, grant=built)

    def revoke(self, grant: RegionDescriptor | int) -> None:
        """End a capability (`grant`): `unregister`, a fence like it."""
        self.unregister(grant)

    def revoke_expired(self) -> int:
        """Unregister the grants past their `ttl_s` (they are refused already); how many."""
        gone = self._regions.expired()
        for region in gone:
            with contextlib.suppress(RegionBusy):  # logged; its ops are refused anyway
                self.unregister(region.region_id)
        return len(gone)

    def unregister(self, region: RegionDescriptor | int) -> None:
        """Forget a region; later ops naming it are refused. Unknown ids are ignored.

        A fence (tcp, shm): ops peers started on it before are cut off or waited for, so
        when this returns no byte of the region moves any more and it may be reused.
        Raises RegionBusy when that could not be made sure of (see errors.py)."""
        region_id = region.region_id if isinstance(region, RegionDescriptor) else region
        removed = self._regions.remove(region_id)
        if removed is not None:
            self._on_unregister(removed)

    # -- transfers ---------------------------------------------------------------------

    async def write(
        self, local: RegionDescriptor, remote: RegionDescriptor, ops: Sequence[Sequence[int]]
    ) -> None:
        """Copy local ranges into the remote region."""
        region, checked = self._prepare(local, remote, ops)
        pending = self._begin("write", region, remote, checked)
        if pending is not None:
            await pending

    async def read(
        self, local: RegionDescriptor, remote: RegionDescriptor, ops: Sequence[Sequence[int]]
    ) -> None:
        """Copy remote ranges into the local region."""
        region, checked = self._prepare(local, remote, ops)
        pending = self._begin("read", region, remote, checked)
        if pending is not None:
            await pending

    def _prepare(
        self, local: RegionDescriptor, remote: RegionDescriptor, ops: Sequence[Sequence[int]]
    ) -> tuple[Region, list[Op]]:
        self._require_running("transfer")
        if not isinstance(remote, RegionDescriptor):
            raise ValueError("remote: expected a RegionDescriptor")
        if remote.transport != self.transport:
            raise ValueError(
                f"remote: descriptor is for transport {remote.transport!r}, "
                f"this engine is {self.transport!r}"
            )
        local_id = local.region_id if isinstance(local, RegionDescriptor) else local
        region = self._regions.get(local_id)
        if region is None:
            raise ValueError(f"local: region {local_id} is not registered with this engine")
        return region, validate_ops(ops, region.length, remote.length)

    def _require_running(self, what: str) -> None:
        if self._state is not EngineState.RUNNING:
            raise RuntimeError(f"{what}: engine is {self._state.value}, not running")

    # -- transport hooks -----------------------------------------------------------------

    @abc.abstractmethod
    async def _start(self) -> None: ...

    @abc.abstractmethod
    async def _stop(self) -> None:
        """Release everything; must work on a half-started engine."""

    @abc.abstractmethod
    def _descriptor(self, region: Region) -> RegionDescriptor: ...

    def _on_register(self, region: Region) -> None:  # noqa: B027 - optional hook
        """Transport-specific registration (shm slot, rdma MR); may raise ValueError."""

    def _on_unregister(self, region: Region) -> None:  # noqa: B027 - optional hook
        """Undo `_on_register`."""

    @abc.abstractmethod
    async def _transfer(
        self, kind: str, region: Region, remote: RegionDescriptor, ops: list[Op]
    ) -> None:
        """Move the validated ops; kind is "write" or "read"."""

    def _begin(
        self, kind: str, region: Region, remote: RegionDescriptor, ops: list[Op]
    ) -> Awaitable[None] | None:
        """Start moving the validated ops: None when they have landed already (a
        transport's inline path, no coroutine), else what completes them."""
        return self._transfer(kind, region, remote, ops)
