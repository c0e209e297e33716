"""A POSIX shared-memory segment with a region table in its first page.

    0                         65536                                 65536 + data_len
    +-------------------------+-------------------------------------+
    | header | slot 0 .. 1022 | data: what engine.allocate() returns |
    +-------------------------+-------------------------------------+

    header (64 B): magic "TNDMSHM1" | version u32 | nslots u32 | data_len u64 | 0...
    slot   (64 B): region_id u64 | offset u64 | length u64 | live u64 | token 16 B | 0...

The owner writes a slot when it registers a region and clears it on unregister, so
a peer holding a stale or forged descriptor is refused before it copies a byte (1023
slots: a decode worker registers its KV pool once per handoff in flight).

Unregistering is a fence (as on tcp, see region.py): a peer *pins* a slot for each
batch with a shared OFD byte-range lock on the slot's 64 bytes of the file, checks the
slot under it, copies, and unpins. The owner clears the slot, then takes an exclusive
lock on the same bytes through its own file description, which it gets only once
every batch that pinned the slot before the clear has finished copying:

    peer:  pin (shared lock) -> slot live? -> memmove ... -> unpin
    owner: clear slot -> exclusive lock (waits for the pins) -> unlock -> free pages

The file is created 0600 under an unguessable name: the OS user is the trust boundary,
the slot check catches stale descriptors and mix-ups. Files live in /dev/shm (a
tmpfs) rather than multiprocessing.shared_memory, whose resource tracker in
Python 3.11 unlinks segments that a *peer* attached to when that peer exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import mmap
import os
import re
import secrets
import struct
import threading
import time

import numpy as np

MAGIC = b"TNDMSHM1"
VERSION = 2
HEADER_BYTES = 65536
SLOT_BYTES = 64
NSLOTS = (HEADER_BYTES - 64) // SLOT_BYTES
_HEADER = struct.Struct("<8sII Q")
_SLOT = struct.Struct("<QQQQ16s")
_NAME = re.compile(r"tandem-[0-9a-f]{32}")
# struct flock for fcntl(F_OFD_SETLK): l_type, l_whence, l_start, l_len, l_pid (0)
_FLOCK = struct.Struct("@hhqqi4x")
# How long the owner's unregister waits for peers' batches on a cleared slot.
FENCE_TIMEOUT_S = 5.0


def _attach_flags(owner_holds_every_page: bool) -> int:
    """A peer maps a segment whose owner already holds every page (a cache store
    prefaults its own) with its page tables filled at once (MAP_POPULATE), instead of
    a minor fault per 4 KiB page on its first copy into each range (measured:
    docs/transfer.md, "Choices, measured"). A segment with
    holes is mapped lazily: populating would allocate the owner's untouched pages."""
    populate = getattr(mmap, "MAP_POPULATE", 0) if owner_holds_every_page else 0
    return mmap.MAP_SHARED | populate


def _slot_at(index: int) -> int:
    return 64 + index * SLOT_BYTES


@functools.lru_cache(maxsize=4 * NSLOTS)
def _flock(kind: int, index: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, _slot_at(index), SLOT_BYTES, 0)


def _lock(fd: int, kind: int, index: int) -> bool:
    """Set an OFD lock (fcntl.F_RDLCK / F_WRLCK / F_UNLCK) on slot `index`, without
    waiting; False when a conflicting lock is held. OFD locks belong to the open file
    description, so two Segment objects of one process conflict like two processes."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(kind, index))
    except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: held by another
        return False
    return True


class Segment:
    """One mapped segment; `create` for the owner, `attach` for peers."""

    def __init__(
        self, name: str, path: str, mm: mmap.mmap, data_len: int, owner: bool, fd: int
    ) -> None:
        self.name = name
        self.path = path
        self._mm = mm
        self._fd = fd  # this object's file description: its pins (shared slot locks)
        # The owner fences through a second description: its own pins never satisfy it.
        self._fence_fd = os.open(path, os.O_RDWR) if owner else -1
        self._pins: dict[int, int] = {}  # slot -> batches of this object pinning it
        self._pins_lock = threading.Lock()  # a batch's copy threads unpin
        self.data_len = data_len
        self.owner = owner
        self.data = memoryview(mm)[HEADER_BYTES : HEADER_BYTES + data_len]
        self.data_addr = ctypes.addressof(ctypes.c_char.from_buffer(self.data))
        # The slot table as u64 columns [region_id, offset, length, live, token, token, ...],
        # so a lookup is one vectorized compare rather than 1023 struct unpacks.
        self._slots: np.ndarray | None = np.frombuffer(
            mm, np.uint64, NSLOTS * SLOT_BYTES // 8, 64
        ).reshape(NSLOTS, 8)
        self._last_slot: dict[int, int] = {}  # region id -> slot it was last found in (a hint)

    @classmethod
    def create(cls, directory: str, nbytes: int) -> Segment:
        name = f"tandem-{secrets.token_hex(16)}"
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + nbytes)
            mm = mmap.mmap(fd, HEADER_BYTES + nbytes)
            mm[: _HEADER.size] = _HEADER.pack(MAGIC, VERSION, NSLOTS, nbytes)
            return cls(name, path, mm, nbytes, owner=True, fd=fd)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise

    @classmethod
    def attach(cls, directory: str, name: str) -> Segment:
        """Map a peer's segment; ValueError when it is not a valid Tandem segment."""
        # The name comes from a descriptor, i.e. from the network: no path tricks.
        if not _NAME.fullmatch(name):
            raise ValueError(f"endpoint: {name!r} is not a Tandem shm segment name")
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_RDWR)
        try:
            stat = os.fstat(fd)
            size = stat.st_size
            if size < HEADER_BYTES:
                raise ValueError(f"segment {name}: too small")
            # The header page range is mostly holes; the data is what the owner touched.
            held = stat.st_blocks * 512 >= size - HEADER_BYTES
            mm = mmap.mmap(fd, size, _attach_flags(held))
            magic, version, nslots, data_len = _HEADER.unpack_from(mm, 0)
            if magic != MAGIC or version != VERSION or nslots != NSLOTS:
                mm.close()
                raise ValueError(f"segment {name}: bad header")
            if data_len > size - HEADER_BYTES:
                mm.close()
                raise ValueError(f"segment {name}: header claims more data than the file holds")
            return cls(name, path, mm, data_len, owner=False, fd=fd)
        except BaseException:
            os.close(fd)
            raise

    def new_view(self) -> memoryview:
        """A fresh view of the data area (callers may hold it past `close`)."""
        return memoryview(self._mm)[HEADER_BYTES : HEADER_BYTES + self.data_len]

    def put(self, region_id: int, offset: int, length: int, token: bytes) -> int:
        """Publish a region in a free slot; ValueError when the table is full."""
        free = np.flatnonzero(self._table()[:, 3] == 0)
        if not free.size:
            raise ValueError(f"buffer: segment {self.name} already holds {NSLOTS} regions")
        index = int(free[0])
        at = _slot_at(index)
        # Fields first, `live` last: a concurrent reader never sees a live
        # slot with a half-written token.
        self._mm[at : at + _SLOT.size] = _SLOT.pack(region_id, offset, length, 0, token)
        self._mm[at + 24 : at + 32] = struct.pack("<Q", 1)
        return index

    def clear(self, index: int, timeout_s: float | None = None) -> bool:
        """Unpublish slot `index`, then wait until no peer's batch that pinned it
        before is still copying (the fence). False if that took over `timeout_s`
        (default FENCE_TIMEOUT_S; a peer stopped mid-copy): the caller must not reuse
        the memory."""
        at = _slot_at(index)
        self._mm[at + 24 : at + 32] = bytes(8)
        self._mm[at : at + _SLOT.size] = bytes(_SLOT.size)
        end = time.monotonic() + (FENCE_TIMEOUT_S if timeout_s is None else timeout_s)
        while not _lock(self._fence_fd, fcntl.F_WRLCK, index):
            if time.monotonic() >= end:
                return False
            time.sleep(0.0005)  # a batch in flight: one copy's time
        _lock(self._fence_fd, fcntl.F_UNLCK, index)
        return True

    def pin(self, region_id: int) -> tuple[int, int, int, bytes] | None:
        """(slot, offset, length, token) of a live region, pinned until `unpin(slot)`:
        the owner's `clear` of that slot waits for it. None when the region is not
        live (or is being unregistered right now)."""
        # The slot it was last found in first, read once under the pin; a stale hint
        # (the slot cleared or reused) costs a scan and a second try.
        hint = self._last_slot.get(region_id)
        index = hint if hint is not None else self._find_slot(region_id)
        if index is None:
            return None
        with self._pins_lock:
            pins = self._pins.get(index, 0)
            if not pins and not _lock(self._fd, fcntl.F_RDLCK, index):
                return None  # the owner is fencing this slot: the region is going away
            self._pins[index] = pins + 1
        # Read under the pin: what the owner clears from now on waits for this batch.
        rid, offset, length, live, token = _SLOT.unpack_from(self._mm, _slot_at(index))
        if live != 1 or rid != region_id:
            self.unpin(index)
            if hint is None:
                return None
            del self._last_slot[region_id]
            return self.pin(region_id)
        return index, offset, length, token

    def unpin(self, index: int) -> None:
        """End one batch's pin (any thread: the last copy thread of a batch calls it)."""
        with self._pins_lock:
            pins = self._pins.pop(index, 0) - 1
            if pins > 0:
                self._pins[index] = pins
            elif self._fd >= 0:  # a closed segment's locks went with its descriptor
                _lock(self._fd, fcntl.F_UNLCK, index)

    def _table(self) -> np.ndarray:
        if self._slots is None:  # dropped by close(), so that the mapping can go
            raise ValueError(f"segment {self.name}: closed")
        return self._slots

    def _find_slot(self, region_id: int) -> int | None:
        """The slot of a live region, or None.

        The slot a region was last found in is tried first (one 64-byte read instead of a
        scan of the table); its contents are checked either way, so a stale hint only
        costs the scan."""
        hint = self._last_slot.get(region_id)
        if hint is not None:
            rid, _, _, live, _ = _SLOT.unpack_from(self._mm, _slot_at(hint))
            if live == 1 and rid == region_id:
                return hint
            del self._last_slot[region_id]
        for index in np.flatnonzero(self._table()[:, 0] == np.uint64(region_id)):
            rid, _, _, live, _ = _SLOT.unpack_from(self._mm, _slot_at(int(index)))
            if live == 1 and rid == region_id:
                if len(self._last_slot) >= NSLOTS:
                    self._last_slot.clear()
                self._last_slot[region_id] = int(index)
                return int(index)
        return None

    def close(self) -> None:
        """Unmap (and unlink, for the owner). Mappings peers hold stay valid."""
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        # Views handed out by allocate() may still be alive; the mapping then goes
        # away with the last of them.
        self._slots = None
        with self._pins_lock:
            for fd in (self._fd, self._fence_fd):
                if fd >= 0:
                    os.close(fd)  # drops this object's locks with its file description
            self._fd = self._fence_fd = -1
            self._pins.clear()
        with contextlib.suppress(BufferError):
            self.data.release()
            self._mm.close()
