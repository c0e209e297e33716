"""The KV pool's messages (cache_master, cache_store, PoolClient): columnar batches.

The same envelope and error contract as every other message (libs/common/messages/control.py:
`v`, `type`, MessageError naming the field), with a faster checker for flat fields.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from libs.common.messages.control import SCHEMA_VERSION, M, Message, MessageError

# --- the KV pool ---------------------------------------------------------------------------
#
#   store                        master (tandem.pool.master.*, queue group)      client
#     |-- PoolMount ------------->| segment descriptor + what the store holds       |
#     |-- PoolStoreRef (heartbeat, 1 s) -->|                                        |
#     |<== PoolStoreUpdate =======| objects added/removed on this store (publish)   |
#     |                           |<-- PoolPutStart (keys, sizes, checksums) ------|
#     |                           |--> PoolPutStartReply (where to write) -------->|
#     |<======= bytes, transfer engine write (client -> store segment) ============|
#     |                           |<-- PoolPutFinish (put_end / put_revoke) -------|
#     |                           |<-- PoolKeys (get) -> PoolGetReply + lease -----|
#     |======== bytes, transfer engine read (store segment -> client) ===========>|
#
# Keys are page keys (kv_hash: 32 hex chars), checksums xxh3-64 as 16 hex chars, segments
# transfer-engine RegionDescriptor dicts. Batches travel as columns (parallel lists, one
# entry per object) and each segment descriptor once per reply: a 64-key get is then a
# handful of flat lists, which PoolMessage checks in microseconds, where the generic
# decoder above spends ~50 us per nested object.


def _flat(kind: type) -> Any:
    # type() identity, not isinstance: a JSON `true` must not pass for an int, and this
    # runs once per element of 64-key batches on every request.
    return lambda v: type(v) is list and all(type(x) is kind for x in v)


def _nested(kind: type) -> Any:
    return lambda v: (
        type(v) is list and all(type(x) is list and all(type(y) is kind for y in x) for x in v)
    )


def _dict_of(item: Any) -> Any:
    return lambda v: type(v) is dict and all(type(k) is str and item(x) for k, x in v.items())


_POOL_CHECKS = {
    "str": lambda v: type(v) is str,
    "int": lambda v: type(v) is int,
    "float": lambda v: type(v) in (int, float),
    "bool": lambda v: type(v) is bool,
    "list[str]": _flat(str),
    "list[int]": _flat(int),
    "list[list[str]]": _nested(str),
    "list[list[int]]": _nested(int),
    "dict[str, Any]": _dict_of(lambda v: True),
    "dict[str, dict[str, Any]]": _dict_of(_dict_of(lambda v: True)),
    "dict[str, dict[str, int]]": _dict_of(_dict_of(lambda v: type(v) is int)),
}


@dataclass
class PoolMessage(Message):
    """Base of the pool's messages: flat fields only, checked by a table built per class.

    Same envelope and error contract as Message (MessageError naming the field); fields
    are limited to the annotations in _POOL_CHECKS, so a nested dataclass cannot sneak in.
    `COLUMNS` names list fields that must all have the same length.
    """

    COLUMNS: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        checks = dict(getattr(cls, "_checks", {}))  # inherited fields first
        for name, hint in inspect.get_annotations(cls).items():
            if hint.startswith("ClassVar"):
                continue
            if hint not in _POOL_CHECKS:
                raise TypeError(f"{cls.__name__}.{name}: unsupported pool field type {hint}")
            checks[name] = (_POOL_CHECKS[hint], name not in cls.__dict__, hint)
        cls._checks = checks  # fixed at import; never changed after

    def __post_init__(self) -> None:
        lengths = {len(getattr(self, c)) for c in self.COLUMNS}
        if len(lengths) > 1:
            raise ValueError(f"columns {list(self.COLUMNS)} differ in length")

    def to_dict(self) -> dict[str, Any]:
        body = {name: getattr(self, name) for name in self._checks}
        return {"v": SCHEMA_VERSION, "type": self.TYPE, **body}

    @classmethod
    def from_dict(cls: type[M], obj: Any) -> M:
        if not isinstance(obj, dict):
            raise MessageError(f"{cls.TYPE}: expected a JSON object")
        if obj.get("v", SCHEMA_VERSION) != SCHEMA_VERSION:
            raise MessageError(f"{cls.TYPE}: schema version {obj.get('v')!r} not supported "
                               f"(this build speaks {SCHEMA_VERSION})")  # fmt: skip
        if obj.get("type", cls.TYPE) != cls.TYPE:
            raise MessageError(f"expected message type {cls.TYPE!r}, got {obj.get('type')!r}")
        values = {}
        for name, (check, required, hint) in cls._checks.items():
            if name in obj:
                value = obj[name]
                if not check(value):
                    raise MessageError(f"{cls.TYPE}.{name}: expected {hint}")
                values[name] = float(value) if hint == "float" else value
            elif required:
                raise MessageError(f"{cls.TYPE}.{name}: required field missing")
        try:
            return cls(**values)
        except (TypeError, ValueError) as e:
            raise MessageError(f"{cls.TYPE}: {e}") from None


class PoolRecord(NamedTuple):
    """One object on one store: where its bytes are and their checksum."""

    key: str
    offset: int
    size: int
    checksum: str


@dataclass
class PoolRecords(PoolMessage):
    """Objects on one store, as columns (mount report, mount reply, index updates)."""

    TYPE: ClassVar[str] = "pool_records"
    COLUMNS: ClassVar[tuple[str, ...]] = ("keys", "offsets", "sizes", "checksums")
    keys: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    checksums: list[str] = field(default_factory=list)

    def records(self) -> list[PoolRecord]:
        columns = (self.keys, self.offsets, self.sizes, self.checksums)
        return [PoolRecord(*r) for r in zip(*columns, strict=True)]

    def set_records(self, records: list[PoolRecord]) -> None:
        self.keys = [r.key for r in records]
        self.offsets = [r.offset for r in records]
        self.sizes = [r.size for r in records]
        self.checksums = [r.checksum for r in records]


@dataclass
class PoolMount(PoolRecords):
    """Store -> master: mount (or re-mount) my segment; the columns are what it holds.

    A re-mount of the same region (same `segment.region_id`) keeps what the master knows
    of it; a new region (the store restarted) replaces it with what is reported.
    """

    TYPE: ClassVar[str] = "pool_mount"
    store_id: str = ""
    segment: dict[str, Any] = field(default_factory=dict)


@dataclass
class PoolMountReply(PoolRecords):
    """Master -> store: the objects the master now records on this store (authoritative)."""

    TYPE: ClassVar[str] = "pool_mount_reply"
    rejected: int = 0
    update_seq: int = 0


@dataclass
class PoolStoreUpdate(PoolRecords):
    """Master -> store (publish on `tandem.pool.store.<id>.update`): index changes.

    The columns are objects now visible on the store, `removed` keys it no longer holds.
    `seq` counts updates to this store from 1 per master run; a store that sees a gap
    re-mounts to get the authoritative list.
    """

    TYPE: ClassVar[str] = "pool_store_update"
    seq: int = 0
    removed: list[str] = field(default_factory=list)


@dataclass
class PoolStoreRef(PoolMessage):
    """Names one store (unmount, heartbeat) and the region it serves."""

    TYPE: ClassVar[str] = "pool_store_ref"
    store_id: str
    region_id: int = 0
    update_seq: int = 0


@dataclass
class PoolHeartbeatReply(PoolMessage):
    """`known` false: the master lost this store (restart, timeout): mount again."""

    TYPE: ClassVar[str] = "pool_heartbeat_reply"
    known: bool
    update_seq: int = 0


@dataclass
class PoolPutStart(PoolMessage):
    """Client -> master: reserve room for these objects on `replicas` distinct stores."""

    TYPE: ClassVar[str] = "pool_put_start"
    COLUMNS: ClassVar[tuple[str, ...]] = ("keys", "sizes", "checksums")
    keys: list[str]
    sizes: list[int]
    checksums: list[str]
    replicas: int = 0  # 0: the master's --replicas


@dataclass
class PoolLocations(PoolMessage):
    """Where objects live: per object, its replicas' store ids and offsets (empty: none);
    `segments` maps each store id named to its segment descriptor."""

    TYPE: ClassVar[str] = "pool_locations"
    stores: list[list[str]] = field(default_factory=list)
    offsets: list[list[int]] = field(default_factory=list)
    segments: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.stores) != len(self.offsets) or any(
            len(s) != len(o) for s, o in zip(self.stores, self.offsets, strict=True)
        ):
            raise ValueError("stores and offsets differ in shape")
        if any(sid not in self.segments for ids in self.stores for sid in ids):
            raise ValueError("a store id has no segment")


@dataclass
class PoolPutStartReply(PoolLocations):
    """Per object `statuses[i]`: `ok` (write every location, then put_end), `exists` or
    `full`. `put_id` names this reservation; put_end/put_revoke must present it."""

    TYPE: ClassVar[str] = "pool_put_start_reply"
    COLUMNS: ClassVar[tuple[str, ...]] = ("statuses", "stores", "offsets")
    put_id: str = ""
    statuses: list[str] = field(default_factory=list)
    put_timeout: float = 0.0


@dataclass
class PoolPutFinish(PoolMessage):
    """Client -> master: put_end (make `keys` visible) or put_revoke (free them)."""

    TYPE: ClassVar[str] = "pool_put_finish"
    put_id: str
    keys: list[str]


@dataclass
class PoolKeys(PoolMessage):
    """A batch of keys (get, exists, remove; put_end's reply: the keys made visible)."""

    TYPE: ClassVar[str] = "pool_keys"
    keys: list[str]


@dataclass
class PoolCount(PoolMessage):
    """How many keys a request affected (put_revoke, remove) or found (exists)."""

    TYPE: ClassVar[str] = "pool_count"
    count: int


@dataclass
class PoolGetReply(PoolLocations):
    """Per requested key: `sizes[i]`, `checksums[i]` and its locations (none: a miss),
    leased for `lease_ttl` seconds from when the master answered.

    A reader must finish within the lease (counted from when it sent the request) or
    treat the bytes as invalid: after it the master may free and reuse them.
    """

    TYPE: ClassVar[str] = "pool_get_reply"
    COLUMNS: ClassVar[tuple[str, ...]] = ("sizes", "checksums", "stores", "offsets")
    sizes: list[int] = field(default_factory=list)
    checksums: list[str] = field(default_factory=list)
    lease_ttl: float = 0.0


@dataclass
class PoolStats(PoolMessage):
    """Master statistics; `stores` maps store id -> {capacity, used, objects}."""

    TYPE: ClassVar[str] = "pool_stats"
    objects: int
    pending: int
    bytes: int
    capacity: int
    hits: int
    misses: int
    evictions: int
    stores: dict[str, dict[str, int]] = field(default_factory=dict)
