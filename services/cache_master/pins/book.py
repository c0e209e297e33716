"""Soft pins: prefixes (a system prompt's pages) that eviction skips while their TTL lasts.

Pure Python, no I/O; times are unix seconds passed in (`now`), because a pin outlives its
master: it is saved in the masters' JetStream bucket (pins/saved.py) and a new leader, on
another host, must expire it at the same moment.

A pin names page keys, present in the pool or not: an object put later under a pinned
key is pinned from its put_end. Which replicas eviction skips ("held") is decided here:

  - Held: a replica of a visible object whose key a live pin names, on a segment whose
    held bytes stay within `max_fraction` of its capacity. Pins are taken oldest first,
    their keys in order, so when a store's capacity shrinks the newest pins lose their
    hold first, never half of every pin.
  - Bounded: held bytes <= `max_fraction` x capacity on every segment, always (`refresh`
    recomputes it at every sweep, after a mount, and when pins change; a put_end adds
    within the same bound). A pin is refused (409) when the pool could not hold it next to
    the others (`charge`): its present objects' bytes, and for absent keys the size of an
    object of the pool (page objects of a cluster are one size). So pins never take more
    than that fraction of the pool from the LRU, and a refusal is an error, never silent.
  - `max_pins` pins at most, each for at most `max_ttl` seconds; pinning the same keys
    again renews that pin (operators re-apply pins, e.g. from a cron job, without
    duplicates).

Invariants (tests/pool/test_pins.py): eviction never takes a held replica; held bytes of a
segment never exceed the bound; an expired or removed pin holds nothing.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.cache_master.metadata.objects import PoolObject, PoolRequestError, Segment, check_key

MAX_PIN_KEYS = 8192  # libs/common/messages/pins.py: one message, one bucket value
MAX_LABEL = 200


@dataclass(frozen=True)
class PinLimits:
    """The master's pin flags."""

    max_fraction: float = 0.25  # of each segment's capacity, held by pins at most
    max_pins: int = 64
    max_ttl: float = 7 * 24 * 3600.0


@dataclass
class Pin:
    pin_id: str
    keys: tuple[str, ...]  # distinct, in prefix order
    expires_at: float
    created_at: float
    label: str = ""
    tokens: int = 0


@dataclass
class PinBook:
    """The live pins and the replicas they hold; see the module docstring."""

    limits: PinLimits = field(default_factory=PinLimits)
    pins: dict[str, Pin] = field(default_factory=dict)  # in creation order
    _refs: dict[str, int] = field(default_factory=dict)  # key -> live pins naming it
    _held: dict[str, set[str]] = field(default_factory=dict)  # store -> held keys
    _held_bytes: dict[str, int] = field(default_factory=dict)  # store -> their bytes

    # --- questions eviction and the service ask --------------------------------------------

    def pinned(self, key: str) -> bool:
        return key in self._refs

    def holds(self, obj: PoolObject, segment: Segment) -> bool:
        """Whether eviction must skip `obj`'s replica on `segment`."""
        held = self._held.get(segment.store_id)
        return held is not None and obj.key in held

    def held_bytes(self, store_id: str | None = None) -> int:
        if store_id is not None:
            return self._held_bytes.get(store_id, 0)
        return sum(self._held_bytes.values())

    def budget(self, segments: Iterable[Segment]) -> int:
        return sum(self._segment_budget(s) for s in segments)

    def _segment_budget(self, segment: Segment) -> int:
        return int(self.limits.max_fraction * segment.capacity)

    # --- pins ------------------------------------------------------------------------------

    def add(
        self,
        keys: list[str],
        ttl: float,
        now: float,
        objects: Mapping[str, PoolObject],
        segments: Mapping[str, Segment],
        *,
        label: str = "",
        tokens: int = 0,
    ) -> Pin:
        """Pin `keys` for `ttl` seconds, or renew the pin of exactly these keys; raises
        PoolRequestError 400 (bad keys or TTL) or 409 (over a bound)."""
        distinct = tuple(dict.fromkeys(check_key(k) for k in keys))
        label = label[:MAX_LABEL]
        if not distinct:
            raise PoolRequestError(400, "keys: a pin needs at least one page key")
        if len(distinct) > MAX_PIN_KEYS:
            raise PoolRequestError(400, f"keys: {len(distinct)} > {MAX_PIN_KEYS} per pin")
        if not 0 < ttl <= self.limits.max_ttl:
            raise PoolRequestError(400, f"ttl_s: must be in (0, {self.limits.max_ttl:g}] "
                                   f"(--max-pin-ttl), got {ttl!r}")  # fmt: skip
        same = next((p for p in self.pins.values() if p.keys == distinct), None)
        if same is not None:  # a renewal: nothing more to hold
            same.expires_at = max(same.expires_at, now + ttl)
            same.label, same.tokens = label or same.label, tokens or same.tokens
            return same
        if len(self.pins) >= self.limits.max_pins:
            raise PoolRequestError(409, f"{len(self.pins)} pins live: the limit is "
                                   f"{self.limits.max_pins} (--max-pins); unpin one or wait "
                                   "for one to expire")  # fmt: skip
        budget = self.budget(segments.values())
        before = self.charge(self._refs, objects)
        after = self.charge([*self._refs, *distinct], objects)
        if after > budget:
            raise PoolRequestError(409, f"pinning {len(distinct)} pages needs ~{after - before} "
                                   f"bytes; pins would hold {after} of the {budget} bytes "
                                   "allowed (--max-pinned-fraction of the pool's capacity); "
                                   "unpin something or pin a shorter prefix")  # fmt: skip
        pin = Pin(secrets.token_hex(8), distinct, now + ttl, now, label, tokens)
        self.restore(pin)
        return pin

    def restore(self, pin: Pin) -> None:
        """Take a pin as it is (a saved one, read by a new leader): no bound is checked;
        `refresh` keeps the held bytes within the bound anyway."""
        self.pins[pin.pin_id] = pin
        for key in pin.keys:
            self._refs[key] = self._refs.get(key, 0) + 1

    def remove(self, pin_id: str) -> Pin | None:
        pin = self.pins.pop(pin_id, None)
        if pin is not None:
            for key in pin.keys:
                left = self._refs.get(key, 0) - 1
                if left > 0:
                    self._refs[key] = left
                else:
                    self._refs.pop(key, None)
        return pin

    def expire(self, now: float) -> list[Pin]:
        ended = [p for p in self.pins.values() if p.expires_at <= now]
        for pin in ended:
            self.remove(pin.pin_id)
        return ended

    def charge(self, keys: Iterable[str], objects: Mapping[str, PoolObject]) -> int:
        """Bytes the pool would hold for `keys` (distinct): a present object's replicas,
        and for an absent key one object of the pool's usual size."""
        typical = next((o.size for o in objects.values() if o.complete), 0)
        total = 0
        for key in dict.fromkeys(keys):
            obj = objects.get(key)
            if obj is not None and obj.complete and obj.replicas:
                total += obj.size * len(obj.replicas)
            else:
                total += typical
        return total

    # --- what is held -----------------------------------------------------------------------

    def refresh(self, objects: Mapping[str, PoolObject], segments: Mapping[str, Segment]) -> None:
        """Recompute the held replicas: pins oldest first, each segment within its bound."""
        self._held, self._held_bytes = {}, {}
        for pin in self.pins.values():
            for key in pin.keys:
                obj = objects.get(key)
                if obj is not None:
                    self.hold(obj, segments)

    def hold(self, obj: PoolObject, segments: Mapping[str, Segment]) -> None:
        """A visible object under a pinned key: hold each replica the bound allows."""
        if not obj.complete or obj.key not in self._refs:
            return
        for replica in obj.replicas:
            segment = segments.get(replica.store_id)
            held = self._held.setdefault(replica.store_id, set())
            if segment is None or obj.key in held:
                continue
            used = self._held_bytes.get(replica.store_id, 0)
            if used + obj.size <= self._segment_budget(segment):
                held.add(obj.key)
                self._held_bytes[replica.store_id] = used + obj.size

    def describe(self, pin: Pin, objects: Mapping[str, PoolObject]) -> tuple[int, int, int]:
        """(present, held replicas, held bytes) of one pin now."""
        present = held = size = 0
        for key in pin.keys:
            obj = objects.get(key)
            if obj is None or not obj.complete:
                continue
            present += 1
            copies = sum(key in keys for keys in self._held.values())
            held, size = held + copies, size + copies * obj.size
        return present, held, size
