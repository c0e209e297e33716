"""Pure parts of the rdma transport: the queue-pair exchange messages, the state of a
link to one peer, and the accounting of posted work requests. No pyverbs here, so
all of it is unit-tested on machines without a device.

Connecting to a peer (the exchange travels over NATS, wired by the service):

    A: engine.write(.., remote desc, ..)         B (owner of the region)
       link IDLE -> CONNECTING
       create n QPs (RESET), request = QpExchange(A's qps)
       reply = await connect_peer(desc.endpoint, request) ---NATS--->  engine.accept_peer(request)
                                                                       create n QPs -> RTS
                                         <---------------------------  reply = QpExchange(B's qps)
       A's QPs -> INIT -> RTR -> RTS (to_rts)
       link CONNECTING -> READY; post RDMA WRITE/READ

    IDLE --connect--> CONNECTING --ok--> READY --completion error--> ERROR
     ^                    |                                            |
     +------ failed ------+<--------------- next use reconnects -------+
    any state --close--> CLOSED (terminal)
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1
_U32 = (1 << 32) - 1
_PSN_MAX = (1 << 24) - 1


def _uint(data: Mapping[str, Any], name: str, limit: int) -> int:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise ValueError(f"{name}: expected an integer in [0, {limit}], got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class QpInfo:
    """What a peer needs to connect an RC queue pair to ours."""

    qpn: int  # queue pair number (24 bits)
    psn: int  # initial packet sequence number (24 bits)
    lid: int  # InfiniBand local id (0 on RoCE)
    gid: str  # 32 hex chars: the port GID (RoCE needs it)
    mtu: int  # ibv_mtu enum value (1..5 = 256..4096 bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"qpn": self.qpn, "psn": self.psn, "lid": self.lid, "gid": self.gid, "mtu": self.mtu}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QpInfo:
        if not isinstance(data, Mapping):
            raise ValueError("qp: expected a JSON object")
        gid = data.get("gid")
        if not isinstance(gid, str) or len(gid) != 32:
            raise ValueError("gid: expected 32 hex characters")
        try:
            bytes.fromhex(gid)
        except ValueError:
            raise ValueError("gid: not hexadecimal") from None
        return cls(
            qpn=_uint(data, "qpn", _PSN_MAX),
            psn=_uint(data, "psn", _PSN_MAX),
            lid=_uint(data, "lid", 0xFFFF),
            gid=gid,
            mtu=_uint(data, "mtu", 5),
        )


@dataclass(frozen=True, slots=True)
class QpExchange:
    """Request and reply of the queue-pair exchange: the sender's engine id and QPs.

    A request also carries the id and token of one region it holds a descriptor for:
    one-sided RDMA bypasses the owner's CPU, so the owner checks the token here, once
    per peer, and connects only peers that hold a valid descriptor. Replies leave
    region_id 0 and token "".
    """

    engine_id: str
    qps: tuple[QpInfo, ...]
    region_id: int = 0
    token: str = field(default="", repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": SCHEMA_VERSION,
            "engine_id": self.engine_id,
            "qps": [q.to_dict() for q in self.qps],
            "region_id": self.region_id,
            "token": self.token,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QpExchange:
        if not isinstance(data, Mapping) or data.get("v") != SCHEMA_VERSION:
            raise ValueError(f"v: unsupported qp exchange schema {data.get('v')!r}")
        engine_id, qps = data.get("engine_id"), data.get("qps")
        if not isinstance(engine_id, str) or not engine_id:
            raise ValueError("engine_id: expected a non-empty string")
        if not isinstance(qps, list) or not 1 <= len(qps) <= 64:
            raise ValueError("qps: expected a list of 1..64 queue pairs")
        token = data.get("token", "")
        if not isinstance(token, str) or len(token) not in (0, 32):
            raise ValueError("token: expected 32 hex characters or empty")
        try:
            bytes.fromhex(token)
        except ValueError:
            raise ValueError("token: not hexadecimal") from None
        region_id = _uint(data, "region_id", (1 << 64) - 1) if "region_id" in data else 0
        return cls(engine_id, tuple(QpInfo.from_dict(q) for q in qps), region_id, token)


class LinkState(enum.Enum):
    IDLE = "idle"
    CONNECTING = "connecting"
    READY = "ready"
    ERROR = "error"
    CLOSED = "closed"


_ALLOWED = {
    LinkState.IDLE: {LinkState.CONNECTING, LinkState.CLOSED},
    LinkState.CONNECTING: {LinkState.READY, LinkState.IDLE, LinkState.CLOSED},
    LinkState.READY: {LinkState.ERROR, LinkState.CLOSED},
    LinkState.ERROR: {LinkState.CONNECTING, LinkState.CLOSED},
    LinkState.CLOSED: set(),
}


@dataclass
class Link:
    """State of the connection to one peer engine (see the module sketch)."""

    peer: str
    state: LinkState = LinkState.IDLE
    reason: str = ""

    def move(self, to: LinkState, reason: str = "") -> None:
        if to not in _ALLOWED[self.state]:
            raise RuntimeError(f"link to {self.peer}: cannot go {self.state.value} -> {to.value}")
        self.state, self.reason = to, reason

    @property
    def usable(self) -> bool:
        return self.state is LinkState.READY


@dataclass
class _Batch:
    remaining: int
    error: str | None = None
    op_index: int = -1


@dataclass
class WorkTracker:
    """Maps posted work requests to batches; a batch is done when all its WRs are.

    Every WR is signaled so that the first failing one names its op. wr ids are
    unique for the life of the engine (64-bit counter).
    """

    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _wrs: dict[int, tuple[int, int]] = field(default_factory=dict)  # wr -> (batch, op)
    _batches: dict[int, _Batch] = field(default_factory=dict)

    def open(self, batch_id: int, count: int) -> None:
        if count <= 0:
            raise ValueError(f"count: a batch needs at least one work request, got {count}")
        self._batches[batch_id] = _Batch(count)

    def post(self, batch_id: int, op_index: int) -> int:
        wr_id = next(self._ids)
        self._wrs[wr_id] = (batch_id, op_index)
        return wr_id

    def complete(self, wr_id: int, ok: bool, status: str = "") -> tuple[int, _Batch] | None:
        """Record one completion; returns (batch_id, batch) when the batch is finished."""
        entry = self._wrs.pop(wr_id, None)
        if entry is None:
            return None  # a completion for a batch already failed and forgotten
        batch_id, op_index = entry
        batch = self._batches.get(batch_id)
        if batch is None:
            return None
        if not ok and batch.error is None:
            batch.error, batch.op_index = status or "work request failed", op_index
        batch.remaining -= 1
        if batch.remaining == 0:
            del self._batches[batch_id]
            return batch_id, batch
        return None

    def forget(self, batch_id: int) -> list[int]:
        """Drop a batch given up on (timed out, cancelled) and its outstanding work
        requests; returns their wr ids. A late completion of one is then ignored. A
        batch whose every work request completed is gone already: nothing to scan."""
        if self._batches.pop(batch_id, None) is None:
            return []
        dropped = [wr for wr, (batch, _) in self._wrs.items() if batch == batch_id]
        for wr in dropped:
            del self._wrs[wr]
        return dropped

    @property
    def outstanding(self) -> int:
        return len(self._wrs)
