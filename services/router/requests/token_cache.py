"""A prompt's token ids, cached by the hash of its text.

The same long prompt sent again (a client's retries, a flood of one body, the shared
system prompt of every request of an application) is tokenized once: the ids are kept
by the BLAKE2b digest of the text, as 4-byte arrays, least recently used first out, up to
`max_ids` ids in all (16 MiB at the default), so a client cannot grow it past its bound.
Texts shorter than MIN_CHARS are not kept (tokenizing them costs less than the keeping).
Safe from several threads (the router's CPU threads, services/router/state.py).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict

MIN_CHARS = 1024
MAX_IDS = 4 << 20


class IdsCache:
    def __init__(self, max_ids: int = MAX_IDS):
        self.max_ids = max_ids
        self._items: OrderedDict[bytes, tuple[array, int]] = OrderedDict()
        self._ids = 0
        self._lock = threading.Lock()

    @staticmethod
    def key(owner: object, text: str) -> bytes | None:
        """The key of `text` tokenized by `owner` (None: too short to keep)."""
        if len(text) < MIN_CHARS:
            return None
        digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=20)
        digest.update(id(owner).to_bytes(8, "little"))
        return digest.digest()

    def get(self, key: bytes) -> tuple[list[int], int] | None:
        """The ids kept under `key` (a new list) and the count the limit is checked on."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
        ids, counted = item
        return ids.tolist(), counted

    def put(self, key: bytes, ids: list[int], counted: int) -> None:
        if len(ids) > self.max_ids // 4:  # one prompt never takes over the whole cache
            return
        kept = array("I", ids)
        with self._lock:
            if key in self._items:
                return
            self._items[key] = (kept, counted)
            self._ids += len(kept)
            while self._ids > self.max_ids:
                _, (old, _) = self._items.popitem(last=False)
                self._ids -= len(old)

    def __len__(self) -> int:
        return len(self._items)


IDS = IdsCache()
