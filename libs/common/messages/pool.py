"""The KV pool's messages (cache_master, cache_store, PoolClient).

Ordinary messages (libs/common/messages/schema.py): the same envelope, the same decoder and
the same errors as every other message. A batch is a list of typed records, one per
object, each checked like any field (`pool_get_reply.objects[3].size: Expected `int`...`).

    store                        master (tandem.pool.master.*, queue group)      client
      |-- PoolMount, PoolMountChunk.., PoolMountEnd -->| segment + what it holds,|
      |<-- PoolMountReply pages (PoolMountPage) -------| in chunks (mounts.py)    |
      |-- PoolStoreRef (heartbeat, 1 s) -->|                                        |
      |<-- PoolReplicate (copy from another store) ---| after a store is lost    |
      |<-- PoolGrant (a put's or get's ranges) -------| -> PoolGrantReply        |
      |<== PoolStoreUpdate =======| objects added/removed on this store (publish)   |
      |                           |<-- PoolPutStart (keys, sizes, checksums) ------|
      |                           |--> PoolPutStartReply (where to write) -------->|
      |<======= bytes, transfer engine write (client -> store segment) ============|
      |                           |<-- PoolPutFinish (put_end / put_revoke) -------|
      |                           |<-- PoolKeys (get) -> PoolGetReply + lease -----|
      |======== bytes, transfer engine read (store segment -> client) ===========>|
      |                           |<-- PoolDrop (a replica failed checksum/MAC) ----|

Store <-> master messages carry the master epoch (services/cache_master/ha/epoch.py); masters
announce theirs with `PoolMasterEpoch`.

Keys are page keys (kv_hash: 32 hex chars), checksums xxh3-64 as 16 hex chars, MAC tags
`<key id>.<mac>` (8 + 32 hex chars, libs/common/pool/integrity.py) or "", segments
transfer-engine RegionDescriptor dicts (checked by RegionDescriptor.from_dict where used),
each sent once per reply however many replicas name its store.
"""

from __future__ import annotations

from typing import Any

from msgspec import field

from libs.common.messages.schema import Message, Record


class PoolRecord(Record):
    """One object on one store: where its bytes are, their checksum and the writer's MAC
    tag (libs/common/pool/integrity.py; "" if written with integrity off)."""

    key: str
    offset: int
    size: int
    checksum: str
    mac: str = ""


class PoolReplica(Record):
    """One copy of an object: store `store` holds its bytes at `offset` of its segment."""

    store: str
    offset: int


class PoolNewObject(Record):
    """An object a put wants room for (its bytes are not sent: the checksum and the MAC
    tag are theirs)."""

    key: str
    size: int
    checksum: str
    mac: str = ""


class PoolSlot(Record):
    """put_start's answer for one object: `status` is `ok` (write every replica, then
    put_end), `exists` or `full` (no replicas)."""

    status: str
    replicas: list[PoolReplica] = field(default_factory=list)


class PoolFound(Record):
    """get's answer for one key: its size, checksum, MAC tag and replicas (none: a miss).
    `error` "pinned": the object has been leased without a break for the master's
    --max-lease-pin; it is not leased again until its lease ends (no replicas)."""

    size: int = 0
    checksum: str = ""
    replicas: list[PoolReplica] = field(default_factory=list)
    error: str = ""
    mac: str = ""


def _check_segments(replicas: list[list[PoolReplica]], segments: dict[str, Any]) -> None:
    for rs in replicas:
        for r in rs:
            if r.store not in segments:
                raise ValueError(f"store {r.store!r} has no segment")


# A mount chunk or page holds at most this many records and about this many bytes (a key
# is up to 256 chars), far below NATS's 1 MiB max payload.
MOUNT_CHUNK_RECORDS = 8192
MOUNT_CHUNK_BYTES = 512 << 10
# JSON of one record besides its key and MAC tag: names, offset, size, checksum.
_RECORD_OVERHEAD = 90


def chunk_records(records: list[PoolRecord]) -> list[list[PoolRecord]]:
    """`records` cut into chunks within MOUNT_CHUNK_RECORDS and ~MOUNT_CHUNK_BYTES (at
    least one chunk, maybe empty)."""
    chunks: list[list[PoolRecord]] = [[]]
    size = 0
    for record in records:
        cost = len(record.key) + len(record.mac) + _RECORD_OVERHEAD
        if chunks[-1] and (
            len(chunks[-1]) >= MOUNT_CHUNK_RECORDS or size + cost > MOUNT_CHUNK_BYTES
        ):
            chunks.append([])
            size = 0
        chunks[-1].append(record)
        size += cost
    return chunks


class PoolStoreUpdate(Message, tag="pool_store_update"):
    """Master -> store (publish on `tandem.pool.store.<id>.update`): index changes.

    `records` are objects now visible on the store, `removed` keys it no longer holds.
    `seq` counts updates to this store from 1 per master run; a store that sees a gap
    re-mounts to get the authoritative list.
    """

    seq: int
    records: list[PoolRecord] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    epoch: int = 0


class PoolStoreRef(Message, tag="pool_store_ref"):
    """Names one store (unmount, heartbeat) and the region it serves; `epoch`: the
    highest master epoch the store has seen."""

    store_id: str
    region_id: int = 0
    update_seq: int = 0
    epoch: int = 0


class PoolHeartbeatReply(Message, tag="pool_heartbeat_reply"):
    """`known` false: the master lost this store (restart, timeout): mount again."""

    known: bool
    update_seq: int = 0
    epoch: int = 0


# A master epoch is (milliseconds since 1970 << 16) | 16 bits (epoch.py in cache_master);
# one above what the clock allows a day from now is a lie or a bug, refused everywhere
# (a forged 2**63 would otherwise fence every master for good).
EPOCH_RANDOM_BITS = 16
EPOCH_CLOCK_SLACK_MS = 86_400_000


def epoch_ceiling(now_ns: int) -> int:
    """The highest plausible master epoch at `now_ns` (time.time_ns())."""
    ms = now_ns // 1_000_000 + EPOCH_CLOCK_SLACK_MS
    return (ms << EPOCH_RANDOM_BITS) | ((1 << EPOCH_RANDOM_BITS) - 1)


class PoolMasterEpoch(Message, tag="pool_master_epoch"):
    """Master -> masters (publish on `tandem.pool.master.epoch`): I serve with `epoch`.

    A master that hears a higher epoch is stale: it stops serving. One that hears a lower
    one announces its own, so the stale one learns. Issue 26's election will set it.
    """

    epoch: int
    master_id: str = ""


class PoolPutStart(Message, tag="pool_put_start"):
    """Client -> master: reserve room for these objects on `replicas` distinct stores."""

    objects: list[PoolNewObject]
    replicas: int = 0  # 0: the master's --replicas
    client: str = ""  # who asks: the master caps pending objects per client


class PoolPutStartReply(Message, tag="pool_put_start_reply"):
    """One slot per object asked for, in order. `put_id` names this reservation;
    put_end/put_revoke must present it. `segments` maps each store a slot names to its
    segment descriptor."""

    put_id: str
    slots: list[PoolSlot]
    segments: dict[str, dict[str, Any]] = field(default_factory=dict)
    put_timeout: float = 0.0
    epoch: int = 0

    def __post_init__(self) -> None:
        _check_segments([s.replicas for s in self.slots], self.segments)


class PoolPutFinish(Message, tag="pool_put_finish"):
    """Client -> master: put_end (make `keys` visible) or put_revoke (free them)."""

    put_id: str
    keys: list[str]


class PoolKeys(Message, tag="pool_keys"):
    """A batch of keys (get, exists, remove; put_end's reply: the keys made visible)."""

    keys: list[str]


class PoolBadCopy(Record):
    """A replica a reader found bad: its bytes at `offset` on `store` failed the checksum
    or the MAC tag the reader was given with them (both repeated here)."""

    key: str
    store: str
    offset: int
    checksum: str
    mac: str = ""


class PoolDrop(Message, tag="pool_drop"):
    """Client -> master (`drop`): forget these bad replicas. Only a report that matches
    the master's record (same checksum and tag, same store and offset) drops anything,
    so a late or mistaken report cannot remove other bytes (docs/pool.md, "Integrity")."""

    copies: list[PoolBadCopy]


class PoolCount(Message, tag="pool_count"):
    """How many keys a request affected (put_revoke, remove) or found (exists)."""

    count: int


class PoolGetReply(Message, tag="pool_get_reply"):
    """One `PoolFound` per requested key, in order, leased for `lease_ttl` seconds from
    when the master answered. `segments` maps each store named to its descriptor.

    A reader must finish within the lease (counted from when it sent the request) or
    treat the bytes as invalid: after it the master may free and reuse them.
    """

    objects: list[PoolFound]
    segments: dict[str, dict[str, Any]] = field(default_factory=dict)
    lease_ttl: float = 0.0

    def __post_init__(self) -> None:
        _check_segments([o.replicas for o in self.objects], self.segments)


class PoolStats(Message, tag="pool_stats"):
    """Master statistics; `stores` maps store id -> {capacity, used, objects}."""

    objects: int
    pending: int
    bytes: int
    capacity: int
    hits: int
    misses: int
    evictions: int
    stores: dict[str, dict[str, int]] = field(default_factory=dict)
    epoch: int = 0
    under_replicated: int = 0
    repaired: int = 0
    # SSD tiers (services/cache_master/tiers/ssd_orders.py): objects on SSD only / with an SSD copy,
    # spilled, promoted back to DRAM, dropped by a tier's size bound or checksum.
    ssd: dict[str, int] = field(default_factory=dict)


class PoolCopy(Record):
    """One object a store is asked to copy into its own segment at `offset`, from
    `source`'s segment at `source_offset`."""

    key: str
    size: int
    checksum: str
    offset: int
    source: str
    source_offset: int


class PoolGrant(Message, tag="pool_grant"):
    """Master -> store (request on `tandem.pool.store.<id>.grant`): a capability on this
    store's segment for one put or one get (docs/pool.md, "Capabilities"): `mode` "write"
    (a put's allocated ranges, until put_end/put_revoke or `ttl`, the put timeout) or
    "read" (a get's replicas, for `ttl`, its lease), over `ranges` ([offset, length] in the
    segment); and/or end the grants `revoke` (their region ids). Refused (409) unless from
    the master of the store's epoch. The reply's `descriptor` is what the master hands the
    client in place of the segment's own (which it never gives to clients)."""

    epoch: int
    mode: str = ""
    ranges: list[list[int]] = field(default_factory=list)
    ttl: float = 0.0
    revoke: list[int] = field(default_factory=list)


class PoolGrantReply(Message, tag="pool_grant_reply"):
    descriptor: dict[str, Any] = field(default_factory=dict)  # {} when only revoking
    revoked: int = 0


class PoolReplicate(Message, tag="pool_replicate"):
    """Master -> store (request on `tandem.pool.store.<id>.replicate`): read `copies` from
    the stores named (descriptors in `segments`) into my segment, check each checksum,
    answer the keys copied (`PoolKeys`). Refused (409) below the store's highest epoch."""

    epoch: int
    copies: list[PoolCopy]
    segments: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for copy in self.copies:
            if copy.source not in self.segments:
                raise ValueError(f"store {copy.source!r} has no segment")


# --- SSD tiers (docs/pool.md, "SSD tier") ---------------------------------------------------


class PoolSsdOrder(Message, tag="pool_ssd_order"):
    """Master -> store (request on `tandem.pool.store.<id>.ssd`), about its SSD tier:
    `op` "spill" (copy each record's bytes from my segment at its `offset` into a file of
    my tier, checking the checksum over the copy), "promote" (read each record's file back
    into my segment at its `offset`, a range the master reserved, checking the checksum),
    or "remove" (delete their files; offsets unused). Refused (409) unless from the master
    of the store's epoch. Answered with `PoolSsdReply`. The store serves these one at a
    time, in order: an empty "remove" is the master's fence (its answer means every order
    sent before it has ended)."""

    epoch: int
    op: str
    records: list[PoolRecord] = field(default_factory=list)


class PoolSsdReply(Message, tag="pool_ssd_reply"):
    """`done`: the keys spilled, promoted or removed. `dropped`: keys the tier no longer
    holds (its --ssd-size bound dropped its oldest files to make room, or a file failed
    its checksum and was deleted). `degraded`: seconds until the tier writes again (its
    disk refused a write: full, read-only; 0 when writable): send no spills before."""

    done: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    degraded: float = 0.0


class PoolSsdReport(Message, tag="pool_ssd_report"):
    """Store -> master (`ssd_report`), after each mount: chunk `index` of `chunks` of what
    the store's SSD tier holds (offsets 0), re-indexed and checksummed at its start. The
    master replaces what it knew of the tier with the whole report once the last chunk is
    in; `capacity` is the tier's --ssd-size (0: no tier)."""

    store_id: str
    index: int
    chunks: int
    capacity: int
    records: list[PoolRecord] = field(default_factory=list)
    epoch: int = 0
