"""A store's mount on the master, in chunks: what its segment holds, staged on the master
until the last chunk, then the master's authoritative list of it, in pages (the master's
side: services/cache_master/stores/mounts.py; docs/pool.md, "Mounts in chunks").

    store                                        master
      |-- PoolMount (segment, first chunk) -------->|  -> PoolMountReply (mount_id)
      |-- PoolMountChunk (index 1.., in order) ---->|  -> PoolCount (records so far)
      |-- PoolMountEnd (chunks, records) ---------->|  -> PoolMountReply (page 0 of P)
      |-- PoolMountPage (1..P-1) ------------------>|  -> PoolMountReply (that page)

Chunks and pages are cut by `chunk_records` (pool.py), within NATS's max payload.
"""

from __future__ import annotations

from typing import Any

from msgspec import field

from libs.common.messages.pool import PoolRecord
from libs.common.messages.schema import Message


class PoolMount(Message, tag="pool_mount"):
    """Store -> master: begin a mount (or re-mount) of my segment; `records` is the first
    chunk of what it holds, the rest follow as `PoolMountChunk`s, then `PoolMountEnd`.

    Nothing changes on the master until the end: then a re-mount of the same region (same
    `segment.region_id`) keeps what the master knows of it, and a new region (the store
    restarted) replaces it with what was reported. `epoch` is the highest master epoch the
    store has seen: a master below it is stale and stops serving (docs/pool.md).
    """

    store_id: str
    segment: dict[str, Any]
    records: list[PoolRecord] = field(default_factory=list)
    epoch: int = 0


class PoolMountChunk(Message, tag="pool_mount_chunk"):
    """Store -> master: chunk `index` (1, 2, ... in order) of mount `mount_id`'s records."""

    store_id: str
    mount_id: str
    index: int
    records: list[PoolRecord] = field(default_factory=list)
    epoch: int = 0


class PoolMountEnd(Message, tag="pool_mount_end"):
    """Store -> master: the mount's last message; `chunks` counts the begin and every
    chunk, `records` every record sent. The master applies the mount only if both match."""

    store_id: str
    mount_id: str
    chunks: int
    records: int
    epoch: int = 0


class PoolMountPage(Message, tag="pool_mount_page"):
    """Store -> master: page `page` of a finished mount's authoritative record list."""

    store_id: str
    mount_id: str
    page: int
    epoch: int = 0


class PoolMountReply(Message, tag="pool_mount_reply"):
    """Master -> store. To the begin: `mount_id` (no records). To the end and to each
    `PoolMountPage`: page `page` of `pages` of the objects the master now records on this
    store (authoritative), as of index update `update_seq`; `rejected` counts reports the
    master refused."""

    records: list[PoolRecord] = field(default_factory=list)
    rejected: int = 0
    update_seq: int = 0
    epoch: int = 0
    mount_id: str = ""
    page: int = 0
    pages: int = 0
