"""Soft pins of the KV pool: the router asks the cache master to keep a prefix's pages.

    router                                   master (tandem.pool.master.*)
      |-- PoolPin (page keys, ttl_s) ------------->| -> PoolPinInfo (409 over the bound)
      |-- PoolPinList (list) --------------------->| -> PoolPinList (every live pin)
      |-- PoolPinRef (pin_id: unpin) ------------->| -> PoolPinInfo (404 unknown)

A pinned object is skipped by the master's eviction while its pin lives, within the
master's bound (services/cache_master/pins/book.py; docs/pool.md, "Soft pinning"). Keys are
page keys (libs/common/engine/core/kv_hash.py), computed by the router from the prefix's
tokens with each live worker's (model id, KV dtype, page size), so they name the objects
workers put into the pool.
"""

from __future__ import annotations

from msgspec import field

from libs.common.messages.schema import Message

# One pin's keys travel in one message and one JetStream value (NATS: 1 MiB by default):
# 8,192 keys of 32 hex chars are ~300 KB. A context of 128k tokens in pages of 16 fits.
MAX_PIN_KEYS = 8192
MAX_PIN_LABEL = 200


class PoolPin(Message, tag="pool_pin"):
    """Router -> master (`pin`): keep these objects (present now or put later) out of
    eviction for `ttl_s` seconds. Pinning the same keys again renews that pin's expiry.
    `tokens` and `label` are for the operator's listing only."""

    keys: list[str]
    ttl_s: float
    label: str = ""
    tokens: int = 0


class PoolPinRef(Message, tag="pool_pin_ref"):
    """Router -> master (`unpin`): end pin `pin_id` now."""

    pin_id: str


class PoolPinInfo(Message, tag="pool_pin_info"):
    """One pin as the master holds it. `pages`: its distinct keys; `present`: those in the
    pool now; `held`: replicas eviction skips now (within the bound); `bytes`: theirs.
    Times are unix seconds (the leader's clock)."""

    pin_id: str
    pages: int
    expires_at: float
    created_at: float
    label: str = ""
    tokens: int = 0
    present: int = 0
    held: int = 0
    bytes: int = 0


class PoolPinList(Message, tag="pool_pin_list"):
    """Router -> master (`pins`, empty) and its reply: every live pin, the bytes eviction
    skips for them now, and the bound (`--max-pinned-fraction` of the pool's capacity)."""

    pins: list[PoolPinInfo] = field(default_factory=list)
    held_bytes: int = 0
    budget_bytes: int = 0


class PoolPinRecord(Message, tag="pool_pin_record"):
    """A pin as saved in the masters' JetStream KV bucket (key `pin.<pin_id>`,
    services/cache_master/pins/saved.py), so that a new leader keeps it."""

    pin_id: str
    keys: list[str]
    expires_at: float
    created_at: float
    label: str = ""
    tokens: int = 0


class PoolPinIndex(Message, tag="pool_pin_index"):
    """The ids of the saved pins (key `pins` of the same bucket): a new leader reads it,
    then each `pin.<id>`, with plain gets (no consumer on the bucket)."""

    pin_ids: list[str] = field(default_factory=list)
