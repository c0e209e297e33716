"""A store's SSD tier: page objects the master spilled out of the DRAM segment, as files.

    --ssd-dir DIR     one file per object, DIR/<xxh3-128 of the key>.kv:
                        b"TNDMSSD1" | u32 header length | header (JSON: key, size,
                        checksum, mac) | the object's bytes
                      written to a .tmp file and renamed, so a name never holds half a file
    --ssd-size N      the tier's bound on object bytes; a spill that does not fit drops the
                      tier's least recently used files first (written or promoted, oldest
                      first) and reports their keys to the master

Each file describes itself (no separate index that a crash could leave behind the data):
at start `scan()` reads every file, checks its header and the xxh3-64 checksum of its
bytes, deletes the bad ones and stale .tmp files, and rebuilds the LRU from the files'
modification times; the store then reports the tier to the master (PoolSsdReport).

A write the disk refuses (ENOSPC, EROFS, EIO: any OSError) deletes its .tmp file and
degrades the tier for --ssd-retry-interval seconds (`fail`): no spill is written, the
master is told (`degraded` in its replies) and keeps those objects in DRAM only; reads
(promotions) and removals go on. The first write after that tries the disk again.

A promotion reads the file into memory first and copies it into the segment only if the
order is still valid then (`promote_io`'s `valid`: the store is on the mount the order came
under), so a late read never lands in a range the master has since handed out again.

Threads: `scan`, `spill_io`, `promote_io` and `unlink` do the file I/O and are called with
asyncio.to_thread; the index (`entries`, `used`) and the degraded state are changed only
on the event loop, by `reserve`, `add`, `touch`, `forget`, `fail` and `recovered`.
"""

from __future__ import annotations

import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson
import xxhash

from libs.common.log import get_logger
from libs.common.messages.pool import PoolRecord
from services.cache_store.segment import checksum

log = get_logger(__name__)

MAGIC = b"TNDMSSD1"
_LEN = struct.Struct("<I")
MAX_HEADER = 4096  # key up to 256 chars, tag, checksum: far below

Promoted = Literal["done", "bad", "stale"]  # read in; file bad (deleted); order no longer valid


@dataclass(frozen=True)
class SsdEntry:
    size: int
    checksum: str
    mac: str


class SsdTier:
    """Files under `directory`, at most `capacity` object bytes, least recently used first."""

    def __init__(self, directory: str | Path, capacity: int, retry_s: float = 30.0):
        self.directory = Path(directory)
        self.capacity = capacity
        self.entries: OrderedDict[str, SsdEntry] = OrderedDict()  # oldest first
        self.used = 0
        self.retry_s = retry_s
        self.degraded_until = 0.0  # time.monotonic(): no writes before
        self.write_errors = 0
        self.last_error = ""

    def path(self, key: str) -> Path:
        """Keys may be up to 256 chars (a file name is at most 255) and `..` is a valid key:
        files are named by a hash of the key, and the key is checked in the header."""
        return self.directory / f"{xxhash.xxh3_128_hexdigest(key.encode())}.kv"

    def records(self) -> list[PoolRecord]:
        return [PoolRecord(k, 0, e.size, e.checksum, e.mac) for k, e in self.entries.items()]

    # --- the index (event loop) ----------------------------------------------------------

    def reserve(self, size: int, keep: set[str]) -> list[str] | None:
        """Make room for `size` more bytes: forget the oldest entries not in `keep` until
        it fits; return their keys (their files are to be unlinked), or None if `size`
        cannot fit at all."""
        if size > self.capacity:
            return None
        dropped: list[str] = []
        for key in list(self.entries):
            if self.used + size <= self.capacity:
                break
            if key not in keep:
                self.forget(key)
                dropped.append(key)
        return dropped if self.used + size <= self.capacity else None

    def add(self, key: str, entry: SsdEntry) -> None:
        self.forget(key)
        self.entries[key] = entry
        self.used += entry.size

    def touch(self, key: str) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)

    def forget(self, key: str) -> SsdEntry | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.used -= entry.size
        return entry

    # --- a disk that refuses writes (event loop) -------------------------------------------

    def degraded(self) -> float:
        """Seconds until the tier writes again (0: writable)."""
        return max(0.0, self.degraded_until - time.monotonic())

    def fail(self, error: OSError) -> None:
        """A write failed: DRAM only for `retry_s` (logged when it starts, not per write)."""
        if not self.degraded_until:
            log.warning("ssd tier degraded: a write failed; objects stay in DRAM only until "
                        "a retry", error=str(error), retry_s=self.retry_s,
                        path=str(self.directory))  # fmt: skip
        self.write_errors += 1
        self.last_error = str(error)
        self.degraded_until = time.monotonic() + self.retry_s

    def recovered(self) -> None:
        """A write succeeded: the tier is writable again."""
        if self.degraded_until:
            log.info("ssd tier writable again", path=str(self.directory),
                     write_errors=self.write_errors)  # fmt: skip
            self.degraded_until = 0.0

    # --- file I/O (threads) --------------------------------------------------------------

    def scan(self) -> int:
        """Re-index the directory (call in a thread, before the tier is used): keep each
        file whose header and checksum hold, oldest first, within `capacity`; delete the
        others. Returns how many files were dropped."""
        self.directory.mkdir(parents=True, exist_ok=True)
        found: list[tuple[float, str, SsdEntry]] = []
        dropped = 0
        for path in self.directory.iterdir():
            if path.suffix == ".tmp":
                _unlink(path)  # a write the store did not finish
                continue
            if path.suffix != ".kv" or not path.is_file():
                continue
            loaded = self._read(path, None)
            if loaded is None:
                log.warning("ssd file dropped: bad header or checksum", path=str(path))
                _unlink(path)
                dropped += 1
                continue
            key, entry, _ = loaded
            found.append((path.stat().st_mtime, key, entry))
        found.sort()
        for _, key, entry in found:
            self.add(key, entry)
        while self.used > self.capacity:  # --ssd-size shrank since the files were written
            key = next(iter(self.entries))
            self.forget(key)
            _unlink(self.path(key))
            dropped += 1
        return dropped

    def spill_io(self, view: memoryview, record: PoolRecord) -> SsdEntry | None:
        """Copy `record`'s bytes out of the segment and write its file (a thread). The
        checksum is computed over the copy: bytes that changed under us (the range was
        freed and written again) are not the object, and nothing is written."""
        data = bytes(view[record.offset : record.offset + record.size])
        if checksum(data) != record.checksum:
            return None
        header = orjson.dumps({"key": record.key, "size": record.size,
                               "checksum": record.checksum, "mac": record.mac})  # fmt: skip
        path = self.path(record.key)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + _LEN.pack(len(header)) + header)
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            _unlink(tmp)  # a full disk must not keep the half-written file
            raise
        return SsdEntry(record.size, record.checksum, record.mac)

    def promote_io(
        self, view: memoryview, record: PoolRecord, valid: Callable[[], bool] = lambda: True
    ) -> Promoted:
        """Read `record`'s file and, if `valid()` still holds, copy it into the segment at
        `record.offset` (a thread). "bad" (and the file deleted) when it is missing or its
        header or checksum do not hold; "stale" (nothing written) when the order is no
        longer valid."""
        path = self.path(record.key)
        loaded = self._read(path, record.key)
        if loaded is None or (loaded[1].size, loaded[1].checksum) != (record.size,
                                                                     record.checksum):  # fmt: skip
            _unlink(path)
            return "bad"
        if not valid():
            return "stale"
        view[record.offset : record.offset + record.size] = loaded[2]
        try:
            os.utime(path)  # its place in the LRU after a restart
        except OSError as e:
            log.debug("ssd file time not updated", path=str(path), error=str(e))
        return "done"

    def unlink(self, keys: list[str]) -> None:
        for key in keys:
            _unlink(self.path(key))

    def _read(self, path: Path, key: str | None) -> tuple[str, SsdEntry, bytes] | None:
        """(key, entry, bytes) of a file whose magic, header, name and checksum hold."""
        try:
            raw = path.read_bytes()
        except OSError:
            return None
        try:
            if raw[: len(MAGIC)] != MAGIC:
                return None
            (length,) = _LEN.unpack_from(raw, len(MAGIC))
            start = len(MAGIC) + _LEN.size
            if length > MAX_HEADER:
                return None
            header: dict[str, Any] = orjson.loads(raw[start : start + length])
            name, size = str(header["key"]), int(header["size"])
            entry = SsdEntry(size, str(header["checksum"]), str(header.get("mac", "")))
        except (struct.error, ValueError, KeyError, TypeError):
            return None
        data = raw[start + length :]
        if (key is not None and name != key) or path != self.path(name) or len(data) != size:
            return None
        if checksum(data) != entry.checksum:
            return None
        return name, entry, data


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("ssd file not removed", path=str(path), error=str(e))
