"""What both halves of the KV handoff compute alike: which bytes move, and what guards them.

KV pools share one layout on every worker (engine/model/kv_cache.py):

    buffer[layer, kv, page, slot, kv_head, head_dim]     one slice = one page of one
           L      2   P                                   layer's K (or V): `slice_nbytes`

so page p of (layer, kv) sits at byte ((layer * 2 + kv) * P + p) * slice_nbytes, where P is
that worker's page count. Two workers with different P still agree on everything else,
which the pairing check (model id, page size, KV dtype) guarantees. Runs of consecutive
pages on both sides coalesce into one op.

Handoff verification (docs/security.md, "Capabilities and handoff verification"): the
prefill worker hashes the bytes it wrote (`kv_digest`: xxh3-128, seeded with a secret
per-request seed, of every written page's slices in prompt order) and sends `handoff_mac`
of it, keyed with the cluster's KV secret, in its PrefillResult; the decode worker fences
its pages, hashes what landed in them and decodes only when the MAC matches
(`verify_handoff`). The digest does not depend on where the pages sit in either pool,
so both sides compute it over their own layout.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from libs.common.transfer.region import buffer_view

Op = tuple[int, int, int]


@dataclass(frozen=True)
class KvLayout:
    """What a peer needs to address a worker's KV pool."""

    num_layers: int
    num_pages: int
    slice_nbytes: int

    def offset(self, layer: int, kv: int, page: int) -> int:
        return ((layer * 2 + kv) * self.num_pages + page) * self.slice_nbytes


def page_copy_ops(
    local: KvLayout, local_pages: Sequence[int], remote: KvLayout, remote_pages: Sequence[int]
) -> list[Op]:
    """(local offset, remote offset, length) ops copying local_pages[i] -> remote_pages[i]."""
    if len(local_pages) != len(remote_pages):
        raise ValueError(f"page lists differ in length: {len(local_pages)} != {len(remote_pages)}")
    if (local.num_layers, local.slice_nbytes) != (remote.num_layers, remote.slice_nbytes):
        raise ValueError("KV layouts differ in layers or slice size: workers cannot pair")
    runs: list[tuple[int, int, int]] = []  # (local page, remote page, pages in run)
    for lp, rp in zip(local_pages, remote_pages, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == lp and runs[-1][1] + runs[-1][2] == rp:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((lp, rp, 1))
    ops: list[Op] = []
    for layer in range(local.num_layers):
        for kv in (0, 1):
            for lp, rp, n in runs:
                ops.append(
                    (
                        local.offset(layer, kv, lp),
                        remote.offset(layer, kv, rp),
                        n * local.slice_nbytes,
                    )
                )
    return ops


def handoff_check(token_ids: Sequence[int], page_indices: Sequence[int], first_token: int) -> str:
    """Digest both sides compute: a reply for another prompt or other pages won't match."""
    h = xxhash.xxh3_64()
    for part in (token_ids, page_indices, [first_token]):
        h.update(len(part).to_bytes(4, "little"))
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in part))
    return h.hexdigest()


def page_runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """(first page, count) of each run of consecutive pages, in list order."""
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def page_ranges(layout: KvLayout, pages: Sequence[int]) -> list[tuple[int, int]]:
    """(offset, length) byte ranges of `pages` in a pool of `layout`: what a handoff's
    write capability allows (one range per layer, K/V and run of consecutive pages)."""
    runs = page_runs(pages)
    return [
        (layout.offset(layer, kv, first), n * layout.slice_nbytes)
        for layer in range(layout.num_layers)
        for kv in (0, 1)
        for first, n in runs
    ]


def kv_digest(view: Any, layout: KvLayout, pages: Sequence[int], seed: int = 0) -> bytes:
    """xxh3-128 (seeded with `seed`, handoff_seed) of the KV of `pages` (prompt order) in a
    pool of `layout` whose bytes `view` covers: per layer, K then V, the pages' slices in
    list order. A streaming hash does not depend on how the bytes are cut, so runs of
    consecutive pages are one update and two pools that hold the same KV at other page
    numbers get the same digest."""
    h = xxhash.xxh3_128(seed=seed)
    for start, length in page_ranges(layout, pages):
        h.update(view[start : start + length])
    return h.digest()


@dataclass(frozen=True)
class HandoffClaim:
    """What a prefill worker vouches for: these KV bytes, for this request's prompt, went
    into these pages of that decode worker. Everything the decode worker checks is in it,
    so a MAC of one handoff does not verify another (other request, prompt, pages)."""

    router: str
    request_id: str
    decode_worker: str
    token_ids: Sequence[int]
    page_indices: Sequence[int]
    first_token: int
    digest: bytes

    def encode(self) -> bytes:
        parts = [b"tandem kv handoff v1"]
        for text in (self.router, self.request_id, self.decode_worker):
            parts.append(_lp(text.encode()))
        for ints in (self.token_ids, self.page_indices, [self.first_token]):
            parts.append(_lp(b"".join(int(t).to_bytes(4, "little", signed=True) for t in ints)))
        parts.append(_lp(self.digest))
        return b"".join(parts)


def _lp(data: bytes) -> bytes:
    return len(data).to_bytes(4, "little") + data


def handoff_mac(key: bytes, claim: HandoffClaim) -> str:
    """HMAC-SHA256 (128 bits, hex) of the claim under the handoff key (KvMac.handoff_key)."""
    return hmac.digest(key, claim.encode(), "sha256")[:16].hex()


def verify_handoff(key: bytes, claim: HandoffClaim, mac: str) -> bool:
    return hmac.compare_digest(handoff_mac(key, claim), mac)


def handoff_seed(key: bytes, router: str, request_id: str, decode_worker: str) -> int:
    """The digest's seed for one handoff: secret (from the handoff key) and different for
    each request, so a forger who knows the honest KV cannot aim at a known hash function
    (xxh3 is fast, not collision-resistant; docs/security.md says what this buys)."""
    label = b"seed" + b"".join(_lp(t.encode()) for t in (router, request_id, decode_worker))
    return int.from_bytes(hmac.digest(key, label, "sha256")[:8], "little")


def pool_digest(kv_cache: Any, pages: Sequence[int], seed: int = 0) -> bytes:
    """`kv_digest` of `pages` of a worker's KV pool (engine/model/kv_cache.py). Reads the
    pool's memory; run it in a thread (xxhash releases the GIL): ~3 ms per 100 MB here."""
    view, _ = buffer_view(kv_cache.buffer)
    layout = KvLayout(kv_cache.num_layers, kv_cache.num_pages, kv_cache.slice_nbytes)
    return kv_digest(view, layout, pages, seed)
