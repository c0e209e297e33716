"""Which connections the TCP transfer server keeps, and how long a frame may take.

A connection is *unproven* until one of its ops passes the access check (a live region
and its token): until then it may belong to anyone who can reach the port. The rules:

- at most `max_per_ip` connections from one source IP, at most `max_total` in all;
- a new connection over either cap takes the place of the oldest unproven connection
  in that same bucket (its IP, or everyone), which is shut down; where every connection
  of the bucket is proven, the new one is refused (closed at once, no reply).

So silent or token-less connections can hold slots only until newer ones arrive (and
never longer than the server's first-frame deadline), while a peer's connections that
have moved bytes are never pushed out by newcomers. Pure bookkeeping under one lock; the
server does the socket calls. `ServerLimits` holds the caps and the deadlines.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

# After `frame_s`, a payload must keep arriving at this rate: a frame of `length` bytes
# has frame_s + length / MIN_RATE seconds (a 1 MiB slice: frame_s + 1 s).
MIN_RATE = 1 << 20


@dataclass(frozen=True)
class ServerLimits:
    """Deadlines and caps of one transfer server (engine options of the same names,
    docs/transfer.md).

    first_frame_s: a new connection must send a request that passes the access check
    (a live region, its token) within this, or it is closed.
    frame_s: once a frame's header has begun, it must be complete within this; its
    payload then has frame_s + length / MIN_RATE.
    max_connections / max_per_ip: the caps of `Admission`.
    """

    first_frame_s: float = 10.0
    frame_s: float = 10.0
    max_connections: int = 256
    max_per_ip: int = 64

    def __post_init__(self) -> None:
        for name, value in (("first_frame_timeout_s", self.first_frame_s),
                            ("frame_timeout_s", self.frame_s)):  # fmt: skip
            if not 0 < value <= 3600:
                raise ValueError(f"{name}: must be in (0, 3600], got {value}")
        if self.max_connections < 1:
            raise ValueError(f"max_server_connections: must be >= 1, got {self.max_connections}")
        if self.max_per_ip < 1:
            raise ValueError(f"max_connections_per_ip: must be >= 1, got {self.max_per_ip}")

    @property
    def tick_s(self) -> float:
        """How often a blocked recv/send wakes to look at its deadline: a deadline is
        enforced within one tick."""
        return min(1.0, max(0.01, min(self.first_frame_s, self.frame_s) / 8))

    def payload_budget(self, length: int) -> float:
        return self.frame_s + length / MIN_RATE


@dataclass(eq=False)
class PeerConnection:
    """One accepted connection: its socket, source IP, and whether it is proven."""

    sock: Any
    ip: str
    name: str  # "ip:port", for logs
    proven: bool = False  # an op of it passed the access check
    thread: Any = field(default=None, repr=False)


class Admission:
    """The server's table of accepted connections and its caps (see the module doc)."""

    def __init__(self, max_total: int, max_per_ip: int) -> None:
        self.max_total = max_total
        self.max_per_ip = max_per_ip
        self._conns: dict[PeerConnection, None] = {}  # insertion order: oldest first
        self._per_ip: dict[str, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._conns)

    def count(self, ip: str) -> int:
        return self._per_ip.get(ip, 0)

    def all(self) -> list[PeerConnection]:
        with self._lock:
            return list(self._conns)

    def admit(self, conn: PeerConnection) -> tuple[bool, PeerConnection | None]:
        """(kept, evicted): whether `conn` is kept, and the unproven connection it
        replaces (already forgotten here; the caller shuts it down), if any."""
        with self._lock:
            evicted = None
            if self._per_ip.get(conn.ip, 0) >= self.max_per_ip:
                evicted = self._oldest_unproven(conn.ip)
                if evicted is None:
                    return False, None
            elif len(self._conns) >= self.max_total:
                evicted = self._oldest_unproven(None)
                if evicted is None:
                    return False, None
            if evicted is not None:
                self._forget(evicted)
            self._conns[conn] = None
            self._per_ip[conn.ip] = self._per_ip.get(conn.ip, 0) + 1
            return True, evicted

    def release(self, conn: PeerConnection) -> None:
        """Forget `conn` (its thread ends); a no-op when it was evicted already."""
        with self._lock:
            if conn in self._conns:
                self._forget(conn)

    def _oldest_unproven(self, ip: str | None) -> PeerConnection | None:
        for conn in self._conns:
            if not conn.proven and (ip is None or conn.ip == ip):
                return conn
        return None

    def _forget(self, conn: PeerConnection) -> None:
        del self._conns[conn]
        left = self._per_ip[conn.ip] - 1
        if left:
            self._per_ip[conn.ip] = left
        else:
            del self._per_ip[conn.ip]
