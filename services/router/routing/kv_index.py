"""The router's global KV index: which worker or store holds which page key, per tier.

Built from `KvEvent`s (`tandem.kv.events.<source>`): `stored` adds (source, tier) as a
holder of each key, `removed` takes it away, `cleared` drops everything a source held in
a tier. A key no one holds is forgotten at once, and at most `max_keys` keys are kept:
beyond that the least recently stored-or-matched key is forgotten (a forgotten key costs a
cache-aware choice, never correctness: workers check their own caches).

Pure Python, no I/O: the service feeds it events and asks `match()` per request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from libs.common.messages.control import KvEvent

POOL = "pool"
# A store's SSD tier is the pool too: a get promotes its objects back into DRAM.
POOL_TIERS = (POOL, "ssd")
WORKER_TIERS = ("device", "host")


@dataclass
class PrefixMatch:
    """Leading pages of one prompt found in the index.

    `local[w]`: pages worker `w` holds itself (device or host tier), from page 0 on.
    `covered[w]`: pages from page 0 on that `w` holds or the pool holds (what `w` need
    not compute). `pool`: leading pages the pool holds.
    """

    pool: int = 0
    local: dict[str, int] = field(default_factory=dict)
    covered: dict[str, int] = field(default_factory=dict)


class KvIndex:
    """Key -> holders map with per-source sets, bounded by `max_keys` (LRU).

    Contract: after any sequence of `apply` calls, `holders(k)` is exactly the set of
    (source, tier) whose last event about `k` was `stored` (and not cleared since), unless
    `k` was evicted by the bound; `len(self) <= max_keys`.
    """

    def __init__(self, max_keys: int):
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._holders: OrderedDict[str, set[tuple[str, str]]] = OrderedDict()
        self._by_source: dict[tuple[str, str], set[str]] = {}
        self._last_seq: dict[str, int] = {}
        self.gaps = 0  # events lost between two of a source's, as counted by `seq`
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._holders)

    def holders(self, key: str) -> set[tuple[str, str]]:
        return set(self._holders.get(key, ()))

    def sources(self) -> set[str]:
        return {source for source, _ in self._by_source}

    def apply(self, event: KvEvent) -> None:
        last = self._last_seq.get(event.source)
        # A smaller seq is a restarted source (it numbers from 1 again), not a gap.
        if last is not None and event.seq > last + 1:
            self.gaps += event.seq - last - 1
        self._last_seq[event.source] = event.seq
        holder = (event.source, event.tier)
        if event.kind == "stored":
            self._store(holder, event.keys)
        elif event.kind == "removed":
            for key in event.keys:
                self._discard(key, holder)
            if not self._by_source.get(holder, True):
                del self._by_source[holder]
        elif event.kind == "cleared":
            tiers = [event.tier] if event.tier else [*WORKER_TIERS, *POOL_TIERS]
            for tier in tiers:
                self._clear((event.source, tier))

    def drop_source(self, source: str) -> None:
        """Forget everything `source` holds (a worker that died takes its cache along)."""
        for holder in [h for h in self._by_source if h[0] == source]:
            self._clear(holder)
        self._last_seq.pop(source, None)

    def match(self, keys: Sequence[str], workers: Iterable[str]) -> PrefixMatch:
        """Leading pages of `keys` held per worker and in the pool; touches what matched."""
        out = PrefixMatch()
        local = dict.fromkeys(workers, True)
        cover = dict(local)
        pool_on = True
        out.local = dict.fromkeys(local, 0)
        out.covered = dict.fromkeys(local, 0)
        for key in keys:
            held = self._holders.get(key)
            if not held:
                break
            self._holders.move_to_end(key)
            in_pool = any(tier in POOL_TIERS for _, tier in held)
            pool_on = pool_on and in_pool
            out.pool += pool_on
            owners = {source for source, tier in held if tier not in POOL_TIERS}
            for w in local:
                if local[w] and w in owners:
                    out.local[w] += 1
                else:
                    local[w] = False
                if cover[w] and (in_pool or w in owners):
                    out.covered[w] += 1
                else:
                    cover[w] = False
            if not pool_on and not any(cover.values()):
                break
        return out

    # -- internals -------------------------------------------------------------------

    def _store(self, holder: tuple[str, str], keys: Iterable[str]) -> None:
        mine = self._by_source.setdefault(holder, set())
        for key in keys:
            held = self._holders.get(key)
            if held is None:
                held = self._holders[key] = set()
            else:
                self._holders.move_to_end(key)
            held.add(holder)
            mine.add(key)
        while len(self._holders) > self.max_keys:
            key, held = self._holders.popitem(last=False)
            self.evicted += 1
            for h in held:
                owned = self._by_source.get(h)
                if owned is not None:
                    owned.discard(key)
                    if not owned:
                        del self._by_source[h]

    def _discard(self, key: str, holder: tuple[str, str]) -> None:
        held = self._holders.get(key)
        if held is not None:
            held.discard(holder)
            if not held:
                del self._holders[key]
        owned = self._by_source.get(holder)
        if owned is not None:
            owned.discard(key)

    def _clear(self, holder: tuple[str, str]) -> None:
        for key in self._by_source.pop(holder, set()):
            held = self._holders.get(key)
            if held is not None:
                held.discard(holder)
                if not held:
                    del self._holders[key]
