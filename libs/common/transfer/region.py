"""Registered regions of one engine and the access check every op goes through.

A region is a writable, C-contiguous span of host memory: a CPU torch tensor, a
bytearray, an mmap, a numpy array or a memoryview of one of those. The table keeps
a reference to the caller's buffer so the memory stays alive while registered.

Unregistering is a fence: an op a peer started before it (the TCP server admitted
its header and is still receiving the payload) is cut off, and `remove` returns only
once no such op touches the region any more. A decode worker relies on this to stop a
late prefill writer before it frees the pages (libs/common/worker/handoff/receiver.py).

    server thread: enter (users.add, then live?) ... payload ... leave (users.discard)
    unregister:    live = False, then cut every user, wait until users is empty
"""

from __future__ import annotations

import bisect
import ctypes
import hmac
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from libs.common.transfer.descriptor import TOKEN_BYTES, U64_MAX
from libs.common.transfer.errors import AccessRefused, RegionBusy
from libs.common.transfer.ops import check_range

# Compared against when the region id is unknown, so that "unknown region" and
# "wrong token" take the same time and a prober learns nothing from timing.
_DUMMY_TOKEN = bytes(TOKEN_BYTES)
# The one answer to a peer for both (and for a region unregistered meanwhile): which of
# them it was is only logged (AccessRefused.detail), so replies do not tell a prober
# which region ids exist.
REFUSED = "unknown region or wrong token"
# How long `remove` waits for cut-off ops to leave; a cut op leaves within one copy.
_DRAIN_TIMEOUT_S = 5.0


def buffer_view(buffer: Any) -> tuple[memoryview, int]:
    """Return a flat writable byte view of `buffer` and its start address.

    Raises ValueError (naming `buffer`) for read-only, non-contiguous or non-CPU
    memory: transports here can only move host memory.
    """
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "element_size"):  # torch.Tensor
        if buffer.device.type != "cpu":
            raise ValueError(f"buffer: {buffer.device} memory is not reachable by this transport")
        if not buffer.is_contiguous():
            raise ValueError("buffer: tensor must be contiguous")
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes == 0:
            raise ValueError("buffer: empty tensor")
        # torch exposes no buffer protocol for every dtype (bf16); go through ctypes.
        array = (ctypes.c_char * nbytes).from_address(buffer.data_ptr())
        return memoryview(array).cast("B"), buffer.data_ptr()
    try:
        view = memoryview(buffer)
    except TypeError:
        raise ValueError(f"buffer: {type(buffer).__name__} does not expose memory") from None
    if view.readonly:
        raise ValueError("buffer: read-only memory cannot be registered")
    if not view.c_contiguous:
        raise ValueError("buffer: memory must be C-contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.nbytes == 0:
        raise ValueError("buffer: empty buffer")
    addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return view, addr


@dataclass(eq=False)
class Region:
    """One registered region: id, secret token and the memory it covers."""

    region_id: int
    token: bytes = field(repr=False)
    view: memoryview = field(repr=False)
    addr: int
    owner: Any = field(repr=False)  # keeps the caller's buffer alive
    extra: dict[str, Any] = field(default_factory=dict)  # transport-specific (MR, slot)
    live: bool = True  # False once unregistered: no op may start on it
    # Ops from peers in progress on this region: each one's cut-off (a TCP server
    # connection's shutdown), called with the region by `RegionTable.remove`.
    users: set[Callable[[Region], None]] = field(default_factory=set, repr=False)
    # A capability (TransferEngine.grant): the only bytes and the only op kind it allows,
    # and until when (time.monotonic). None / "rw" / inf: the whole region, both kinds.
    grant: Grant | None = None

    @property
    def length(self) -> int:
        return self.view.nbytes


MODES = ("read", "write", "rw")


@dataclass(frozen=True)
class Grant:
    """What a capability allows: `mode` ("read", "write" or "rw") on the byte ranges
    `starts[i] .. ends[i]` (sorted, disjoint, merged where they touch; none: nothing is
    allowed), until `expires` (time.monotonic; inf: until revoked)."""

    mode: str
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    expires: float = math.inf

    @classmethod
    def build(cls, ranges: Any, mode: str, region_length: int, expires: float) -> Grant:
        """From (offset, length) pairs; ValueError naming the bad argument."""
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} is not one of {MODES}")
        spans: list[list[int]] = []
        for offset, length in sorted((int(o), int(n)) for o, n in ranges):
            if length <= 0 or not check_range(offset, length, region_length):
                raise ValueError(f"ranges: {offset}+{length} is empty or outside the region")
            if spans and offset <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], offset + length)
            else:
                spans.append([offset, offset + length])
        return cls(mode, tuple(a for a, _ in spans), tuple(b for _, b in spans), expires)

    def refusal(self, kind: str, offset: int, length: int, now: float) -> str | None:
        """Why an op of `kind` ("read"/"write") on offset+length is refused, or None."""
        if now >= self.expires:
            return "grant expired"
        if self.mode != "rw" and self.mode != kind:
            return f"grant is {self.mode}-only"
        i = bisect.bisect_right(self.starts, offset) - 1
        if i < 0 or offset + length > self.ends[i]:
            return f"range {offset}+{length} outside the granted ranges"
        return None


class RegionTable:
    """Thread-safe map region id -> Region (the TCP server reads it from its threads)."""

    def __init__(self) -> None:
        self._regions: dict[int, Region] = {}
        self._lock = threading.Lock()
        self._drained = threading.Condition()  # an op left an unregistered region

    def __len__(self) -> int:
        return len(self._regions)

    def add(self, buffer: Any, grant: Grant | None = None) -> Region:
        view, addr = buffer_view(buffer)
        if grant is not None and grant.ends and grant.ends[-1] > view.nbytes:
            raise ValueError("ranges: outside the region")
        with self._lock:
            while True:
                # Random ids: a descriptor from an earlier run never names a new region.
                region_id = secrets.randbelow(U64_MAX) + 1
                if region_id not in self._regions:
                    break
            region = Region(region_id, secrets.token_bytes(TOKEN_BYTES), view, addr, buffer,
                            grant=grant)  # fmt: skip
            self._regions[region_id] = region
        return region

    def remove(self, region_id: int) -> Region | None:
        """Forget a region; ops in progress on it are cut off and drained first
        (RegionBusy when one does not leave within 5 s; the region is gone anyway)."""
        with self._lock:
            region = self._regions.pop(region_id, None)
        if region is None:
            return None
        region.live = False  # before reading users: see `enter`
        if region.users:
            for cut in list(region.users):
                cut(region)
            with self._drained:
                if not self._drained.wait_for(lambda: not region.users, _DRAIN_TIMEOUT_S):
                    structlog.get_logger("tandem.transfer").error(
                        "unregister: ops still running on the region",
                        region_id=region_id, waited_s=_DRAIN_TIMEOUT_S,
                    )  # fmt: skip
                    raise RegionBusy(f"region {region_id}: a peer's op did not end in time")
        return region

    def enter(
        self, region_id: int, token: bytes, offset: int, length: int,
        cut: Callable[[Region], None], kind: str = "rw",
    ) -> Region:  # fmt: skip
        """`check`, then count the op as running on the region until `leave`; `cut`
        stops it (called from `remove`, any thread)."""
        region = self.check(region_id, token, offset, length, kind)
        region.users.add(cut)
        # Added before reading `live`, and `remove` clears `live` before reading
        # `users` (each step atomic under the GIL): either this op sees the region
        # gone, or `remove` sees the op and cuts it.
        if not region.live:
            self.leave(region, cut)
            raise AccessRefused(REFUSED, f"unknown region {region_id} (unregistered)")
        return region

    def leave(self, region: Region, cut: Callable[[Region], None]) -> None:
        region.users.discard(cut)
        if not region.live:
            with self._drained:
                self._drained.notify_all()

    def get(self, region_id: int) -> Region | None:
        return self._regions.get(region_id)

    def all(self) -> list[Region]:
        with self._lock:
            return list(self._regions.values())

    def expired(self, now: float | None = None) -> list[Region]:
        """Regions whose grant has expired (their owner unregisters them)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return [r for r in self._regions.values() if r.grant and now >= r.grant.expires]

    def check(
        self, region_id: int, token: bytes, offset: int, length: int, kind: str = "rw"
    ) -> Region:
        """The access check for an op from a peer; raises AccessRefused.

        The token is compared in constant time whether or not the region exists, an
        unknown region and a wrong token get the same `reason` (REFUSED; `detail` tells
        them apart for the log), and bounds are checked with overflow-safe arithmetic
        before any memory is touched (only a token holder learns the region's length).
        A capability (`Region.grant`) then allows only its op kind ("read", "write"; "rw"
        is a check of the bounds alone), its ranges, and only until it expires.
        """
        region = self._regions.get(region_id)
        expected = region.token if region is not None else _DUMMY_TOKEN
        token_ok = hmac.compare_digest(expected, token)
        if region is None:
            raise AccessRefused(REFUSED, f"unknown region {region_id}")
        if not token_ok:
            raise AccessRefused(REFUSED, f"wrong token for region {region_id}")
        if not check_range(offset, length, region.length):
            raise AccessRefused(
                f"range {offset}+{length} outside region {region_id} ({region.length} bytes)"
            )
        if region.grant is not None:
            why = region.grant.refusal(kind, offset, length, time.monotonic())
            if why is not None:
                raise AccessRefused(f"{kind} refused: {why}", f"region {region_id}: {why}")
        return region
