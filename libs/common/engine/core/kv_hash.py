"""Chained page keys: the names of KV pages on every worker, store and router.

A page's key is

    h_i = xxh3_128(h_{i-1} || salt || tokens of page i)

where h_{-1} is sixteen zero bytes, the tokens are little-endian int32, and the
salt fixes everything else that changes the bytes of a page: the model id, the
KV dtype and the page size. A request's `cache_salt` (the API's field, a tenant's
secret) replaces h_{-1} with xxh3_128("tandem-cache-salt" || NUL || cache_salt): since
every key chains from its predecessor, no page of a salted request shares a key with a
page of another salt or of no salt, anywhere keys are compared (a worker's radix tree,
the pool, the KV events and the router's index). No salt keeps h_{-1} and today's keys.

Because each key covers its whole prefix, two requests share the key of page i only if
they share tokens 0..(i+1)*page_size (and their cache salt), and one key names the same
bytes in L1, L2 and the pool.

Keys are 32-char lowercase hex strings: hashable, cheap to compare, and
readable on the wire (`nats sub 'tandem.kv.events.>'`). Nothing here depends
on the process (no `hash()`, no native byte order), so every process on every
machine computes the same keys.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

# Bump when the key recipe changes: old keys then name nothing, which is safe.
KEY_SCHEME = "tandem-kv-v1"
KEY_HEX_LEN = 32
_ROOT = bytes(16)
_SALT_TAG = b"tandem-cache-salt\0"


def chain_root(cache_salt: str = "") -> bytes:
    """h_{-1}: the parent of a sequence's first page; sixteen zero bytes without a salt."""
    if not cache_salt:
        return _ROOT
    # surrogatepass: JSON may carry a lone surrogate, which still names one salt.
    return xxhash.xxh3_128_digest(_SALT_TAG + cache_salt.encode("utf-8", "surrogatepass"))


class PageHasher:
    """Computes the chained keys of full pages for one (model, kv dtype, page size).

    Contract:
    - only full pages get keys: `keys(t)` has `len(t) // page_size` entries;
    - `keys(t)[i]` depends on exactly `t[: (i + 1) * page_size]`, the salt and the
      request's `cache_salt` (keys of different cache salts are unrelated);
    - `keys(a + b) == keys(a) + extend(a + b, keys(a))` for any split;
    - different model id, kv dtype or page size give unrelated keys.
    """

    __slots__ = ("_page_bytes", "_salt", "kv_dtype", "model_id", "page_size")

    def __init__(self, model_id: str, kv_dtype: str, page_size: int) -> None:
        if not model_id:
            raise ValueError("model_id must not be empty")
        if not kv_dtype:
            raise ValueError("kv_dtype must not be empty")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.model_id = model_id
        self.kv_dtype = kv_dtype
        self.page_size = page_size
        # NUL separators keep ("ab", "c") and ("a", "bc") apart.
        self._salt = f"{KEY_SCHEME}\0{model_id}\0{kv_dtype}\0{page_size}\0".encode()
        self._page_bytes = 4 * page_size

    def num_full_pages(self, num_tokens: int) -> int:
        return num_tokens // self.page_size

    def keys(
        self, token_ids: Sequence[int], parent: str | None = None, cache_salt: str = ""
    ) -> list[str]:
        """Keys of every full page of `token_ids`, chained after `parent`.

        `parent` is the key of the page just before `token_ids[0]` (None when
        `token_ids` starts the sequence, whose chain then starts at `cache_salt`'s root);
        `token_ids` must then start on a page boundary of the whole sequence. A parent
        key already carries its sequence's salt.
        """
        n_pages = len(token_ids) // self.page_size
        if n_pages == 0:
            return []
        data = _pack(token_ids[: n_pages * self.page_size])
        prev = chain_root(cache_salt) if parent is None else _parse_key(parent)
        salt, step = self._salt, self._page_bytes
        digest = xxhash.xxh3_128_digest
        out: list[str] = []
        for off in range(0, len(data), step):
            prev = digest(prev + salt + data[off : off + step])
            out.append(prev.hex())
        return out

    def extend(
        self, token_ids: Sequence[int], known: Sequence[str], cache_salt: str = ""
    ) -> list[str]:
        """Keys of the full pages of `token_ids` beyond the `len(known)` already known.

        `known` must be the keys of the first `len(known)` pages of the same
        `token_ids` (as returned by earlier calls); only the new keys are
        returned, so a growing sequence hashes each page once.
        """
        start = len(known) * self.page_size
        if start > len(token_ids):
            raise ValueError(f"{len(known)} known keys but only {len(token_ids)} tokens")
        parent = known[-1] if known else None
        return self.keys(token_ids[start:], parent, cache_salt)

    def page_key(
        self, parent: str | None, page_token_ids: Sequence[int], cache_salt: str = ""
    ) -> str:
        """The key of one full page whose predecessor has key `parent` (None: the first
        page of a sequence salted with `cache_salt`)."""
        if len(page_token_ids) != self.page_size:
            raise ValueError(f"a page has {self.page_size} tokens, got {len(page_token_ids)}")
        return self.keys(page_token_ids, parent, cache_salt)[0]


def _pack(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(token_ids)}i", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be int32 integers ({exc})") from exc


def _parse_key(key: str) -> bytes:
    if len(key) != KEY_HEX_LEN:
        raise ValueError(f"a page key is {KEY_HEX_LEN} hex chars, got {key!r}")
    try:
        return bytes.fromhex(key)
    except ValueError as exc:
        raise ValueError(f"a page key is hex, got {key!r}") from exc
