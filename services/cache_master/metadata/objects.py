"""The master's records: segments, objects, replicas, and the changes they produce.

Pure data, no I/O. `PoolMetadata` (metadata.py) owns these and applies the rules.

    object lifecycle:

      put_start --> PENDING --put_end--> COMPLETE --remove/evict--> (gone)
                       |                    |
                       +--revoke/timeout--> (gone)      +--remove while leased--> DOOMED
                                                              (invisible; bytes freed
                                                               when the lease ends)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from services.cache_master.metadata.allocator import OffsetAllocator

KEY_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,256}$")
CHECKSUM_RE = re.compile(r"^[0-9a-f]{16}$")
MAC_RE = re.compile(r"^(?:[0-9a-f]{8}\.[0-9a-f]{32})?$")  # libs/common/pool/integrity.py


class PutSpec(NamedTuple):
    """One object a put wants room for."""

    key: str
    size: int
    checksum: str
    mac: str = ""  # the writer's MAC tag; the master records it, only readers check it


class ReportedRecord(Protocol):
    """A store's report of one object it holds (PoolRecord's fields; the metadata imports
    no messages)."""

    @property
    def key(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def checksum(self) -> str: ...
    @property
    def mac(self) -> str: ...


class BadReport(Protocol):
    """A reader's report of a replica whose bytes failed their checksum or MAC tag
    (PoolBadCopy's fields)."""

    @property
    def key(self) -> str: ...
    @property
    def store(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def checksum(self) -> str: ...
    @property
    def mac(self) -> str: ...


@dataclass
class Replica:
    store_id: str
    offset: int


PutResult = tuple[str, str, list[Replica]]  # put_start's answer for one key: status, replicas


@dataclass(eq=False)
class PoolObject:
    """One object: its bytes live at `replicas`, identical on each (same checksum)."""

    key: str
    size: int
    checksum: str
    replicas: list[Replica]
    complete: bool = False
    put_id: str = ""
    put_deadline: float = 0.0
    lease_until: float = 0.0
    lease_since: float = 0.0  # when the current unbroken lease began
    want: int = 1  # replicas asked for: a lost store's objects are copied back up to it
    client: str = ""  # who reserved it (pending only)
    counted: bool = False  # counted in its client's pending objects
    repair_failures: int = 0  # failed copies back up to `want` (ha/repair_plan.py)
    mac: str = ""  # the writer's MAC tag over key and bytes ("" written without one)
    spilling_until: float = 0.0  # an SSD spill copies its bytes: not evicted (tiers/ssd_orders.py)

    def leased(self, now: float) -> bool:
        return self.lease_until > now

    def on(self, store_id: str) -> Replica | None:
        return next((r for r in self.replicas if r.store_id == store_id), None)


@dataclass(eq=False)
class Segment:
    """One store's mounted segment and which byte ranges of it hold which object."""

    store_id: str
    descriptor: dict[str, Any]
    allocator: OffsetAllocator
    last_seen: float
    keys: set[str] = field(default_factory=set)  # objects (any state) with a replica here
    update_seq: int = 0

    @property
    def region_id(self) -> int:
        return int(self.descriptor.get("region_id", 0))

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def used(self) -> int:
        return self.allocator.used_bytes

    @property
    def use(self) -> float:
        return self.used / self.capacity if self.capacity else 1.0


@dataclass
class Changes:
    """What became visible or went away, per store, since the last `take_changes()`.

    The service turns `added`/`removed` into a store index update and a KV event (tier
    `pool`) for each store; they are the same facts seen by two readers.
    """

    added: dict[str, list[tuple[str, int, int, str, str]]] = field(default_factory=dict)
    removed: dict[str, list[str]] = field(default_factory=dict)

    def add(self, store_id: str, obj: PoolObject, offset: int) -> None:
        self.added.setdefault(store_id, []).append((obj.key, offset, obj.size, obj.checksum,
                                                       obj.mac))  # fmt: skip

    def remove(self, store_id: str, key: str) -> None:
        self.removed.setdefault(store_id, []).append(key)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)

    @property
    def stores(self) -> list[str]:
        return sorted(set(self.added) | set(self.removed))


class PoolRequestError(ValueError):
    """A request the master refuses as a whole; `code` is the reply's error code."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def check_key(key: Any) -> str:
    if not isinstance(key, str) or not KEY_RE.match(key):
        raise PoolRequestError(400, f"key {str(key)[:80]!r}: expected 1-256 of [A-Za-z0-9_.:-]")
    return key


def check_checksum(checksum: Any) -> str:
    if not isinstance(checksum, str) or not CHECKSUM_RE.match(checksum):
        raise PoolRequestError(400, f"checksum {str(checksum)[:40]!r}: expected 16 hex chars")
    return checksum


def check_mac(mac: Any) -> str:
    if not isinstance(mac, str) or not MAC_RE.match(mac):
        raise PoolRequestError(400, f"mac {str(mac)[:60]!r}: expected '' or 8.32 hex chars")
    return mac
