"""Mounts in chunks: a store's report of what it holds, staged until its last chunk.

    store                                   master
      |-- mount (PoolMount: segment, chunk 0) -->|  session opened; nothing changes yet
      |<-- PoolMountReply(mount_id) -------------|
      |-- mount_chunk (index 1..N-1, in order) ->|  records staged
      |-- mount_end (chunks N, records R) ------>|  counts match: the mount is applied at
      |<-- PoolMountReply(page 0 of P) ----------|  once (one handler, no await inside)
      |-- mount_page (1..P-1) ------------------>|  pages of the master's list (as of
      |<-- PoolMountReply(page i) ---------------|  update_seq), kept until read or expired

Pure bookkeeping, no I/O; the clock is passed in. A new mount of a store replaces its
unfinished one. Sessions are bounded in number and expire when idle, so a store that died
mid-mount (or a client that never finishes) holds nothing for long.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from libs.common.messages.pool import MOUNT_CHUNK_RECORDS, PoolRecord, chunk_records
from services.cache_master.metadata.objects import PoolRequestError


@dataclass(eq=False)
class MountSession:
    store_id: str
    mount_id: str
    descriptor: dict[str, Any]
    expires: float
    records: list[PoolRecord] = field(default_factory=list)
    chunks: int = 1
    pages: list[list[PoolRecord]] | None = None  # after the end: the reply's pages
    rejected: int = 0
    update_seq: int = 0

    def listed(self) -> list[list[PoolRecord]]:
        """The master's list in pages: set by `Mounts.finish`, before any page is served."""
        if self.pages is None:
            raise RuntimeError(f"mount {self.mount_id}: not finished")
        return self.pages


class Mounts:
    """Unfinished and finished-but-unread mounts, one per store id."""

    def __init__(self, idle_timeout: float = 30.0, max_sessions: int = 64):
        self.idle_timeout, self.max_sessions = idle_timeout, max_sessions
        self.sessions: dict[str, MountSession] = {}

    def begin(
        self, store_id: str, descriptor: dict[str, Any], records: list[PoolRecord], now: float
    ) -> MountSession:
        self.expire(now)
        if store_id not in self.sessions and len(self.sessions) >= self.max_sessions:
            raise PoolRequestError(503, f"{len(self.sessions)} mounts in progress; retry later")
        _check_chunk(records)
        session = MountSession(store_id, secrets.token_hex(8), descriptor,
                               now + self.idle_timeout, list(records))  # fmt: skip
        self.sessions[store_id] = session
        return session

    def chunk(
        self, store_id: str, mount_id: str, index: int, records: list[PoolRecord], now: float
    ) -> MountSession:
        session = self._find(store_id, mount_id, now)
        if session.pages is not None or index != session.chunks:
            del self.sessions[store_id]  # the store starts its mount again
            raise PoolRequestError(409, f"mount {mount_id}: chunk {index} out of order "
                                   f"(expected {session.chunks}); mount again")  # fmt: skip
        _check_chunk(records)
        session.records += records
        session.chunks += 1
        return session

    def end(
        self, store_id: str, mount_id: str, chunks: int, records: int, now: float
    ) -> MountSession:
        """The session, all its chunks in: the caller applies it and calls `finish`."""
        session = self._find(store_id, mount_id, now)
        if session.pages is not None or (chunks, records) != (session.chunks, len(session.records)):
            del self.sessions[store_id]
            raise PoolRequestError(409, f"mount {mount_id}: got {session.chunks} chunks and "
                                   f"{len(session.records)} records, the end says {chunks} "
                                   f"and {records}; mount again")  # fmt: skip
        return session

    def finish(self, session: MountSession, records: list[PoolRecord], update_seq: int) -> None:
        """Keep the master's list (as of `update_seq`) in pages for the store to read."""
        session.records = []
        session.pages = chunk_records(records)
        session.update_seq = update_seq

    def done(self, session: MountSession) -> None:
        """The store has every page (a one-page answer goes with the end's reply)."""
        if self.sessions.get(session.store_id) is session:
            del self.sessions[session.store_id]

    def page(self, store_id: str, mount_id: str, page: int, now: float) -> MountSession:
        session = self._find(store_id, mount_id, now)
        if session.pages is None or not 0 <= page < len(session.pages):
            raise PoolRequestError(404, f"mount {mount_id}: no page {page}")
        if page == len(session.pages) - 1:
            self.done(session)
        return session

    def expire(self, now: float) -> int:
        stale = [sid for sid, s in self.sessions.items() if s.expires < now]
        for sid in stale:
            del self.sessions[sid]
        return len(stale)

    def _find(self, store_id: str, mount_id: str, now: float) -> MountSession:
        session = self.sessions.get(store_id)
        if session is None or session.mount_id != mount_id or session.expires < now:
            raise PoolRequestError(404, f"no mount {mount_id!r} of store {store_id!r} in "
                                   "progress (expired, or replaced); mount again")  # fmt: skip
        session.expires = now + self.idle_timeout
        return session


def _check_chunk(records: list[PoolRecord]) -> None:
    if len(records) > MOUNT_CHUNK_RECORDS:
        raise PoolRequestError(413, f"{len(records)} records in one mount message, over "
                               f"{MOUNT_CHUNK_RECORDS}; send them in chunks")  # fmt: skip
