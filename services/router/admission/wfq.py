"""Weighted fair queueing of waiting requests between tenants, counting tokens.

Start-time fair queueing: each tenant has a queue (lowest `priority` first, then arrival:
vLLM's order) and a finish tag. The head of tenant t starts at S_t = max(V, F_t); `pop`
serves the eligible head with the smallest S_t, sets V = S_t and F_t = S_t + cost / weight.
A tenant that sent 10x the tokens of another at the same weight waits 10x as long; a
tenant coming back from idle starts at V and cannot claim the share it did not use.

Pure Python, no clock and no asyncio (admission/gate.py holds the waiters).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Entry:
    """A waiting request: `cost` in tokens, `slots` the worker slots it takes when run."""

    tenant: str
    weight: float
    cost: int
    slots: int = 1
    priority: int = 0
    limit: int = 0  # the tenant's max concurrency in slots (0: none of its own)
    seq: int = 0
    waiter: Any = None  # the gate's future
    started: float = 0.0  # when it started running (the gate's clock)
    removed: bool = field(default=False, repr=False)


class FairQueue:
    def __init__(self) -> None:
        self.vtime = 0.0
        self._heads: dict[str, list[tuple[int, int, Entry]]] = {}
        self._finish: dict[str, float] = {}
        self._tokens: dict[str, int] = {}  # queued tokens per tenant
        self._count: dict[str, int] = {}
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def tenants(self) -> list[str]:
        """The tenants with requests waiting."""
        return list(self._heads)

    def queued(self, tenant: str) -> int:
        return self._count.get(tenant, 0)

    def push(self, entry: Entry) -> None:
        entry.seq = next(self._seq)
        heapq.heappush(self._heads.setdefault(entry.tenant, []), (entry.priority, entry.seq, entry))
        self._tokens[entry.tenant] = self._tokens.get(entry.tenant, 0) + entry.cost
        self._count[entry.tenant] = self._count.get(entry.tenant, 0) + 1
        self._len += 1

    def remove(self, entry: Entry) -> bool:
        """Take a waiting entry out (its client left, its deadline passed); False when it
        is not waiting (already served or removed)."""
        heap = self._heads.get(entry.tenant)
        if entry.removed or heap is None:
            return False
        entry.removed = True
        self._forget(entry)
        self._trim(entry.tenant)
        return True

    def pop(
        self,
        eligible: Callable[[Entry], bool],
        fits: Callable[[Entry], bool],
        under_share: Callable[[Entry], bool] | None = None,
    ) -> Entry | None:
        """The next entry to run, or None. Tenants whose head `eligible` refuses (the
        tenant's own bound) are passed over; when the fairest other head does not `fit` the
        free slots, nothing is served (no smaller request overtakes it forever), but for
        the fairest head whose tenant is `under_share` (its share of the slots, which a
        flood must not take from it)."""
        ranked = sorted(
            (max(self.vtime, self._finish.get(tenant, 0.0)), heap[0][2].seq, heap[0][2])
            for tenant, heap in self._heads.items()
            if eligible(heap[0][2])
        )
        if not ranked:
            return None
        chosen = ranked[0]
        if not fits(chosen[2]):
            shares = (r for r in ranked[1:] if under_share is not None and under_share(r[2]))
            found = next(shares, None)
            if found is None:
                return None
            chosen = found
        start, _, entry = chosen
        heapq.heappop(self._heads[entry.tenant])
        self.vtime = max(self.vtime, start)
        self._finish[entry.tenant] = start + entry.cost / entry.weight
        entry.removed = True
        self._forget(entry)
        self._trim(entry.tenant)
        return entry

    def ahead(self, tenant: str, weight: float, priority: int) -> int:
        """Tokens expected to be served before a new entry of `tenant` at `priority`: its
        own queued entries of lower or equal priority, and from each other tenant what it
        is served while its start tag stays below the new entry's."""
        own = sum(
            e.cost
            for _, _, e in self._heads.get(tenant, ())
            if not e.removed and e.priority <= priority
        )
        start = max(self.vtime, self._finish.get(tenant, 0.0)) + own / weight
        total = own
        for other, heap in self._heads.items():
            if other == tenant or not heap:
                continue
            w = heap[0][2].weight
            lead = start - max(self.vtime, self._finish.get(other, 0.0))
            if lead > 0:
                total += min(self._tokens[other], int(lead * w))
        return total

    def _forget(self, entry: Entry) -> None:
        self._tokens[entry.tenant] -= entry.cost
        self._count[entry.tenant] -= 1
        self._len -= 1

    def _trim(self, tenant: str) -> None:
        """Drop removed entries from the head of `tenant`'s heap, and the heap when empty."""
        heap = self._heads[tenant]
        while heap and heap[0][2].removed:
            heapq.heappop(heap)
        if not heap:
            del self._heads[tenant]
            del self._tokens[tenant]
            del self._count[tenant]
