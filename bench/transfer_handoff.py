"""bench.transfer --handoff: what verifying a prefill -> decode KV handoff costs.

A handoff of n pages in the KV layout of the default model (SmolLM2-135M, fp32 KV, 16
tokens a page: 30 layers x K/V slices of 12,288 B, 737,280 B a page) into a peer
process's pool, timed two ways in alternating slices of one run, so load drift on a
shared host hits both alike:

  handoff      the page writes (page_copy_ops, the workers' own op list)
  handoff+mac  the same writes, then what verification adds to the request's critical
               path, in order: the prefill worker's seeded xxh3-128 of the pages it sent and its
               HMAC, then the decode worker's xxh3-128 of the pages that landed and the
               MAC check. The decode side's hash runs here over a buffer of the decode
               pool's layout (the peer's memory is not this process's): the same bytes,
               the same code (worker/handoff/protocol.py).
  mac only     that verification alone (no transfer): its cost without the transfer's
               noise on a loaded host.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from libs.common.pool.integrity import KvMac
from libs.common.transfer import RegionDescriptor
from libs.common.worker.handoff.protocol import (
    HandoffClaim,
    KvLayout,
    handoff_mac,
    handoff_seed,
    kv_digest,
    page_copy_ops,
    verify_handoff,
)

LAYERS, SLICE = 30, 16 * 3 * 64 * 4  # SmolLM2-135M: 3 KV heads of 64, fp32
PAGE_COUNTS = (8, 32, 80)  # 128, 512 and 1,280 prompt tokens
SLICES = 4  # alternating slices per case and mode
MODES = (("handoff", True, False), ("handoff+mac", True, True), ("mac only", False, True))


def layout_for(region_bytes: int) -> KvLayout:
    """The largest pool of this layout that fits `region_bytes`."""
    return KvLayout(LAYERS, region_bytes // (2 * LAYERS * SLICE), SLICE)


def _verify(key: bytes, src: Any, dst: Any, layout: KvLayout, pages: list[int]) -> None:
    remote_pages = list(range(layout.num_pages - len(pages), layout.num_pages))
    seed = handoff_seed(key, "r", "1", "d")
    claim = HandoffClaim("r", "1", "d", [1] * (16 * len(pages)), remote_pages, 7,
                         kv_digest(src, layout, pages, seed))  # fmt: skip
    mac = handoff_mac(key, claim)  # the prefill worker
    seed = handoff_seed(key, "r", "1", "d")
    landed = HandoffClaim("r", "1", "d", claim.token_ids, remote_pages, 7,
                          kv_digest(dst, layout, remote_pages, seed))  # fmt: skip
    if not verify_handoff(key, landed, mac):  # the decode worker (dst: a copy of src)
        raise RuntimeError("bench: the copy did not verify")


async def run_handoff(
    engine: Any, local: RegionDescriptor, remote: RegionDescriptor, memory: Any,
    *, transport: str, seconds: float, max_iters: int, stats: Callable[..., dict[str, Any]],
) -> list[dict[str, Any]]:  # fmt: skip
    """Rows (transport, mode, "<n> pages") for each page count and mode (MODES)."""
    layout = layout_for(min(memory.nbytes, remote.length))
    key = KvMac(os.urandom(32)).handoff_key
    shadow = memoryview(bytearray(memory))  # the decode side's pool, for its hash
    rows = []
    for n in PAGE_COUNTS:
        pages = list(range(n))
        remote_pages = list(range(layout.num_pages - n, layout.num_pages))
        ops = page_copy_ops(layout, pages, layout, remote_pages)
        for p in pages:  # the shadow holds what landed, where it landed
            for layer in range(LAYERS):
                for kv in (0, 1):
                    s, d = layout.offset(layer, kv, p), layout.offset(layer, kv, remote_pages[p])
                    shadow[d : d + SLICE] = memory[s : s + SLICE]
        lat: dict[str, list[float]] = {"handoff": [], "handoff+mac": [], "mac only": []}
        for _ in range(2):  # warm up
            await engine.write(local, remote, ops)
        budget = seconds / (3 * SLICES)
        for _ in range(SLICES):
            for mode, move, check in MODES:
                end = time.perf_counter() + budget
                while len(lat[mode]) < max_iters and (time.perf_counter() < end or not lat[mode]):
                    t0 = time.perf_counter()
                    if move:
                        await engine.write(local, remote, ops)
                    if check:
                        _verify(key, memory, shadow, layout, pages)
                    lat[mode].append(time.perf_counter() - t0)
        for mode, values in lat.items():
            rows.append(stats(transport, mode, f"{n} pages", n * LAYERS * 2 * SLICE, values))
    return rows
