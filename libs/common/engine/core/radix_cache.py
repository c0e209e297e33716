"""The prefix cache of one KV pool: a tree of full pages named by chained keys.

    root -- k0 -- k1 -- k2          each node is one full page: (key, page index);
              \\                     a path from the root is a cached prefix.
               k1' -- k2'

Keys come from `kv_hash.PageHasher`, so a key already implies its whole
prefix; the tree still keeps parent links because eviction must take leaves
first (a page is only useful while the pages before it are cached).

Ownership: a page index inserted here belongs to the cache until `evict` or
`reset` hands it back; the caller then frees it in its allocator. Sequences
that use cached pages hold references (`acquire`/`release`) along their path;
referenced nodes are never evicted.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence
from typing import Literal

EventKind = Literal["stored", "removed", "cleared"]


@dataclasses.dataclass(frozen=True, slots=True)
class CacheEvent:
    """A change of what this tier holds; workers publish it on tandem.kv.events.<id>.

    `stored`: `keys` form a chain hanging under `parent_key` (None: the root).
    `removed`: `keys` left this tier. `cleared`: everything left (keys empty).
    """

    kind: EventKind
    keys: tuple[str, ...]
    tier: str
    parent_key: str | None = None
    num_tokens: int = 0


@dataclasses.dataclass(slots=True)
class CacheStats:
    """Counters of prefix lookups made at admission (pages, not tokens)."""

    queries: int = 0
    hits: int = 0
    query_pages: int = 0
    hit_pages: int = 0

    def record(self, query_pages: int, hit_pages: int) -> None:
        self.queries += 1
        self.hits += hit_pages > 0
        self.query_pages += query_pages
        self.hit_pages += hit_pages

    @property
    def page_hit_rate(self) -> float:
        return self.hit_pages / self.query_pages if self.query_pages else 0.0


class _Node:
    __slots__ = ("children", "key", "last_access", "page", "parent", "ref")

    def __init__(self, key: str, page: int, parent: _Node | None) -> None:
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.ref = 0
        self.last_access = 0


class RadixCache:
    """Longest-prefix lookup, reference counts and LRU eviction over full pages.

    Contract:
    - `match(keys)` returns the pages of the longest cached prefix of `keys`;
    - `insert(keys, pages)` caches a chain that starts at the root (or under
      `parent`); keys already cached keep their page, and the returned list
      gives the cache's page for every key, so where it differs from the
      caller's page, the caller's copy is a duplicate to free;
    - `evict(n)` frees up to n unreferenced leaves, least recently used first;
      a node with references or children is never evicted;
    - every change is reported through `on_event` (tier `tier`), in order.
    Recency is a logical clock bumped by each match/insert/release, so ties
    and wall-clock jumps cannot reorder eviction.
    """

    def __init__(
        self,
        page_size: int,
        *,
        tier: str = "L1",
        on_event: Callable[[CacheEvent], None] | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.tier = tier
        self.on_event = on_event
        self.stats = CacheStats()
        self._root = _Node("", -1, None)
        self._nodes: dict[str, _Node] = {}
        self._page_key: dict[int, str] = {}
        self._clock = 0
        self._num_referenced = 0
        # Candidate LRU leaves as (last_access, key); entries go stale when the
        # node is touched, referenced, gains a child or leaves, and are checked
        # when popped (cheaper than keeping an exact ordered set).
        self._heap: list[tuple[int, str]] = []

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    @property
    def num_evictable(self) -> int:
        """Pages `evict` could free now (unreferenced nodes become leaves in turn)."""
        return len(self._nodes) - self._num_referenced

    def match(self, keys: Sequence[str]) -> list[int]:
        self._clock += 1
        node, pages = self._root, []
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            child.last_access = self._clock
            pages.append(child.page)
            node = child
        self._push_if_evictable(node)
        return pages

    def insert(
        self, keys: Sequence[str], pages: Sequence[int], parent: str | None = None
    ) -> list[int]:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        node = self._root if parent is None else self._node(parent)
        self._clock += 1
        out: list[int] = []
        i = 0
        while i < len(keys) and (child := node.children.get(keys[i])) is not None:
            child.last_access = self._clock
            out.append(child.page)
            node = child
            i += 1
        new_keys, new_pages = tuple(keys[i:]), list(pages[i:])
        # Below a new node everything is new, so the stored keys are one chain;
        # check all of it before changing anything.
        self._check_new(new_keys, new_pages)
        for key, page in zip(new_keys, new_pages, strict=True):
            child = _Node(key, page, node)
            child.last_access = self._clock
            node.children[key] = child
            self._nodes[key] = child
            self._page_key[page] = key
            node = child
        out.extend(new_pages)
        self._push_if_evictable(node)
        if new_keys:
            self._emit("stored", new_keys, keys[i - 1] if i else parent)
        return out

    def acquire(self, keys: Sequence[str]) -> None:
        """Reference each node of `keys` (a path from the root) once."""
        nodes = [self._node(k) for k in keys]
        for node in nodes:
            if node.ref == 0:
                self._num_referenced += 1
            node.ref += 1

    def release(self, keys: Sequence[str]) -> None:
        """Drop one reference from each node of `keys`; they count as used now."""
        nodes = [self._node(k) for k in keys]
        for node in nodes:
            if node.ref <= 0:
                raise ValueError(f"page key {node.key} released more often than acquired")
        self._clock += 1
        for node in nodes:
            node.ref -= 1
            node.last_access = self._clock
            if node.ref == 0:
                self._num_referenced -= 1
                self._push_if_evictable(node)

    def ref_count(self, key: str) -> int:
        return self._node(key).ref

    def evict(self, n_pages: int) -> list[int]:
        """Remove up to `n_pages` unreferenced leaves, LRU first; return their pages."""
        freed: list[int] = []
        removed: list[str] = []
        while len(freed) < n_pages and self._heap:
            tick, key = heapq.heappop(self._heap)
            node = self._nodes.get(key)
            if node is None or node.ref or node.children or node.last_access != tick:
                continue
            parent = node.parent
            if parent is None:  # the root; never pushed, but keep the type checker honest
                continue
            del parent.children[key]
            del self._nodes[key]
            del self._page_key[node.page]
            freed.append(node.page)
            removed.append(key)
            self._push_if_evictable(parent)
        if removed:
            self._emit("removed", tuple(removed), None)
        return freed

    def reset(self) -> list[int]:
        """Drop every page (none may be referenced); return them for freeing."""
        if self._num_referenced:
            raise RuntimeError(f"{self._num_referenced} cached pages are still referenced")
        pages = [n.page for n in self._nodes.values()]
        self._root.children.clear()
        self._nodes.clear()
        self._page_key.clear()
        self._heap.clear()
        self._emit("cleared", (), None)
        return pages

    def _node(self, key: str) -> _Node:
        node = self._nodes.get(key)
        if node is None:
            raise ValueError(f"page key {key} is not cached")
        return node

    def _check_new(self, keys: tuple[str, ...], pages: list[int]) -> None:
        for key in keys:
            if key in self._nodes:
                raise ValueError(f"page key {key} is cached under another parent")
        for page in pages:
            if page in self._page_key:
                raise ValueError(f"page {page} is already cached as {self._page_key[page]}")
        if len(set(pages)) != len(pages) or len(set(keys)) != len(keys):
            raise ValueError("insert got the same page or key twice")

    def _push_if_evictable(self, node: _Node) -> None:
        if node is self._root or node.ref or node.children:
            return
        heapq.heappush(self._heap, (node.last_access, node.key))
        # Stale entries pile up under repeated hits; rebuild before they dominate.
        if len(self._heap) > 2 * len(self._nodes) + 64:
            self._heap = [
                (n.last_access, n.key) for n in self._nodes.values() if not n.ref and not n.children
            ]
            heapq.heapify(self._heap)

    def _emit(self, kind: EventKind, keys: tuple[str, ...], parent: str | None) -> None:
        if self.on_event is not None:
            event = CacheEvent(kind, keys, self.tier, parent, len(keys) * self.page_size)
            self.on_event(event)
