"""A store's segment: the memory peers read and write, and the index of what it holds.

    memory:  engine.allocate(size)                   (anonymous; lost on exit)
         or  mmap(MAP_SHARED) of --segment-file      (kept across restarts and upgrades)

    index:   key -> (offset, size, checksum, MAC tag), as the master confirmed it (mount reply,
             then PoolStoreUpdate messages). With a segment file it is saved next to it,
             PATH.index.json, written to a temporary file and renamed (never half-written).

On a restart with a segment file, every indexed object's bytes are checked against its
xxh3-64 checksum before it is reported to the master: an object whose bytes changed (a
crash mid-write, an index older than the data) is dropped, never served.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import Any

import orjson
import xxhash

from libs.common.messages.pool import PoolRecord
from libs.common.transfer import TransferEngine

INDEX_VERSION = 1


def checksum(data: Any) -> str:
    """xxh3-64 of a buffer, as 16 hex chars (the pool's object checksum)."""
    return xxhash.xxh3_64_hexdigest(data)


class StoreSegment:
    """The segment memory and its index. `close()` is safe to call twice."""

    def __init__(self, view: memoryview, path: Path | None, mm: mmap.mmap | None):
        self.view = view
        self.path = path
        self._mm = mm
        self.index: dict[str, PoolRecord] = {}
        self.dirty = False

    @classmethod
    def open(cls, engine: TransferEngine, size: int, path: str = "") -> StoreSegment:
        """Anonymous memory from the engine, or the file at `path` (created if missing).

        An existing file of another size is refused (ValueError naming --segment-file):
        its offsets would not match, and silently truncating would lose its contents.
        """
        if not path:
            return cls(engine.allocate(size), None, None)
        file = Path(path)
        fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            current = os.fstat(fd).st_size
            if current not in (0, size):
                raise ValueError(
                    f"--segment-file: {file} has {current} bytes, --segment-size says {size}"
                )
            if current == 0:
                os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(memoryview(mm), file, mm)

    def prefault(self) -> None:
        """Touch every page of an anonymous segment now (call in a thread).

        First-touch page faults cost a put of 1 MiB into fresh memory many times its copy
        time (docs/pool.md, "Prefaulted segments"); a store pays them once at start instead,
        and its memory use is the segment size from then on, like pinned RDMA memory.
        File-backed segments are left alone: writing would destroy their contents.
        """
        if self._mm is None:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(self.view))
            ctypes.memset(addr, 0, self.size)

    @property
    def size(self) -> int:
        return self.view.nbytes

    @property
    def index_path(self) -> Path | None:
        return self.path.with_name(self.path.name + ".index.json") if self.path else None

    @property
    def used(self) -> int:
        return sum(r.size for r in self.index.values())

    # --- the index -----------------------------------------------------------------------

    def replace(self, records: list[PoolRecord]) -> None:
        self.index = {r.key: r for r in records}
        self.dirty = True

    def apply(self, added: list[PoolRecord], removed: list[str]) -> None:
        for key in removed:
            self.index.pop(key, None)
        for record in added:
            self.index[record.key] = record
        self.dirty = True

    def load(self) -> list[PoolRecord]:
        """Objects of the saved index whose bytes still match their checksum."""
        path = self.index_path
        if path is None or not path.exists():
            return []
        try:
            data = orjson.loads(path.read_bytes())
            if data.get("v") != INDEX_VERSION or data.get("size") != self.size:
                return []
            # A row without a MAC tag (an index saved before tags): "" (integrity off).
            records = [PoolRecord(str(k), int(o), int(n), str(c), str(m[0]) if m else "")
                       for k, o, n, c, *m in data.get("objects", [])]  # fmt: skip
        except (OSError, ValueError, TypeError, AttributeError):
            return []  # an unreadable index: start empty rather than serve doubtful bytes
        return [r for r in records if self.verify(r)]

    def verify(self, record: PoolRecord) -> bool:
        if record.offset < 0 or record.size <= 0 or record.offset + record.size > self.size:
            return False
        return checksum(self.view[record.offset : record.offset + record.size]) == record.checksum

    def snapshot(self) -> list[PoolRecord] | None:
        """The index to save (segment file only, when changed); call from the event loop."""
        if self.index_path is None or not self.dirty:
            return None
        self.dirty = False
        return list(self.index.values())

    def save(self, records: list[PoolRecord] | None) -> None:
        """Write a snapshot (any thread): the data is flushed first, then the index."""
        path = self.index_path
        if path is None or records is None:
            return
        if self._mm is not None:
            self._mm.flush()
        rows = [(r.key, r.offset, r.size, r.checksum, r.mac) for r in records]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(orjson.dumps({"v": INDEX_VERSION, "size": self.size, "objects": rows}))
        os.replace(tmp, path)

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is None:
            return
        try:
            self.view.release()
            mm.flush()
            mm.close()
        except (BufferError, ValueError):
            pass  # still exported (registered): the mapping goes with the process
