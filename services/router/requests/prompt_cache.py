"""Prompts' rendered text and token ids, cached by the hash of what made them.

The same long prompt sent again (a client's retries, a flood of one body, the shared
system prompt of every request of an application) is rendered through the chat template
and tokenized once: `TEXTS` keeps a chat's prompt text by the BLAKE2b digest of its
messages, tools and template options, `IDS` a text's ids (4-byte arrays) by the digest of
the text; each is least recently used first out and bounded in size (32M characters, 4M
ids), so a client cannot grow them past their bound, and one entry never takes more than a
quarter. Inputs shorter than MIN_CHARS are not kept (the work costs less than the
keeping). Safe from several threads (the router's CPU threads, services/router/state.py).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from typing import Generic, TypeVar

MIN_CHARS = 1024
V = TypeVar("V", str, array)


def key(owner: object, data: bytes) -> bytes | None:
    """The key of `data` as `owner` (the tokenizer) makes it; None when too short."""
    if len(data) < MIN_CHARS:
        return None
    digest = hashlib.blake2b(data, digest_size=20)
    digest.update(id(owner).to_bytes(8, "little"))
    return digest.digest()


def text_key(owner: object, text: str) -> bytes | None:
    return key(owner, text.encode("utf-8", "surrogatepass")) if len(text) >= MIN_CHARS else None


class Bounded(Generic[V]):
    """An LRU of values by key, `limit` in all by len() of the values."""

    def __init__(self, limit: int):
        self.limit = limit
        self._items: OrderedDict[bytes, V] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, k: bytes) -> V | None:
        with self._lock:
            value = self._items.get(k)
            if value is not None:
                self._items.move_to_end(k)
            return value

    def put(self, k: bytes, value: V) -> None:
        if len(value) > self.limit // 4:  # one entry never takes over the whole cache
            return
        with self._lock:
            if k in self._items:
                return
            self._items[k] = value
            self._size += len(value)
            while self._size > self.limit:
                _, old = self._items.popitem(last=False)
                self._size -= len(old)

    def __len__(self) -> int:
        return len(self._items)


TEXTS: Bounded[str] = Bounded(32 << 20)
IDS: Bounded[array] = Bounded(4 << 20)
