"""The prefill -> decode KV handoff: which bytes move, and the check value that guards it.

KV pools share one layout on every worker (engine/model/kv_cache.py):

    buffer[layer, kv, page, slot, kv_head, head_dim]     one slice = one page of one
           L      2   P                                   layer's K (or V): `slice_nbytes`

so page p of (layer, kv) sits at byte ((layer * 2 + kv) * P + p) * slice_nbytes, where P is
that worker's page count. Two workers with different P still agree on everything else,
which the pairing check (model id, page size, KV dtype) guarantees. Runs of consecutive
pages on both sides coalesce into one op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

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
