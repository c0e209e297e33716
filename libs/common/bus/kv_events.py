"""KV-location events on NATS: `tandem.kv.events.<source>`, kept in a JetStream stream.

Every tier change of pages (a worker's prefix cache, a pool store) is published as a
`KvEvent`. The stream keeps them so a restarted router replays the history and rebuilds
its index; `nats sub 'tandem.kv.events.>'` shows them live.

Tiers: `device` is the pool a worker computes from (GPU memory, or host memory on a CPU
worker), `host` a GPU worker's host-memory offload, `pool` the distributed KV pool (a
store's DRAM segment), `ssd` a store's SSD tier below it (docs/pool.md, "SSD tier").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable

from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from libs.common.bus.connection import Bus
from libs.common.engine.core.radix_cache import CacheEvent
from libs.common.log import get_logger
from libs.common.messages.control import KvEvent

log = get_logger(__name__)

STREAM_NAME = "TANDEM_KV_EVENTS"


def events_subject(prefix: str, source: str = ">") -> str:
    return f"{prefix}.kv.events.{source}"


def stream_name(prefix: str) -> str:
    """The events stream of subject prefix `prefix` (one per prefix on a server)."""
    return STREAM_NAME if prefix == "tandem" else f"{STREAM_NAME}_{prefix.upper()}"


async def ensure_kv_stream(
    bus: Bus, prefix: str, max_age_s: float = 3600.0, max_bytes: int = 256 << 20
) -> None:
    """Create the events stream if it does not exist (idempotent, safe from every process).

    Bounded by age and size: old events are dropped first (a router replaying the stream
    then misses pages stored long ago, which costs a cache-aware choice, never correctness).
    """
    js = bus.nc.jetstream()
    name = stream_name(prefix)
    config = StreamConfig(
        name=name,
        subjects=[events_subject(prefix)],
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        storage=StorageType.FILE,
        max_age=max_age_s,
        max_bytes=max_bytes,
    )
    try:
        await js.add_stream(config)
    except BadRequestError as e:  # exists with another config: keep the operator's
        log.info("kv events stream exists", stream=name, detail=str(e))


async def keep_kv_stream(
    bus: Bus, prefix: str, max_age_s: float = 3600.0, max_bytes: int = 256 << 20
) -> None:
    """`ensure_kv_stream` now, and again after every reconnect of `bus`: a nats-server
    restarted without its JetStream store (or a new one on the same address) has lost the
    stream, and events published meanwhile would go nowhere a router replays from."""

    async def again() -> None:
        await retry(lambda: ensure_kv_stream(bus, prefix, max_age_s, max_bytes), "kv stream")

    bus.on_reconnect(again)
    await ensure_kv_stream(bus, prefix, max_age_s, max_bytes)


async def retry(step: Callable[[], Awaitable[None]], what: str, within: float = 60.0) -> bool:
    """Run `step` until it succeeds or `within` seconds pass (backoff 0.25 s -> 4 s).
    JetStream may answer late in a server's first moments; True when it succeeded."""
    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + within, 0.25
    while True:
        try:
            await step()
            return True
        except Exception as e:
            if loop.time() + pause > deadline:
                log.warning("gave up after reconnect", what=what, error=str(e) or type(e).__name__)
                return False
            await asyncio.sleep(pause)
            pause = min(pause * 2, 4.0)


class KvEventPublisher:
    """Turns cache events of one source into numbered `KvEvent` messages on the bus."""

    def __init__(self, bus: Bus, prefix: str, source: str, tier: str = "device"):
        self.bus, self.source, self.tier = bus, source, tier
        self.subject = events_subject(prefix, source)
        self.seq = 0

    def to_message(self, event: CacheEvent) -> KvEvent:
        self.seq += 1
        return KvEvent(
            source=self.source,
            seq=self.seq,
            kind=event.kind,
            tier=self.tier,
            keys=list(event.keys),
            parent_key=event.parent_key or "",
            num_tokens=event.num_tokens,
            timestamp=time.time(),
        )

    async def publish(self, events: Iterable[CacheEvent]) -> None:
        """Publish in order. Failures are logged: an event lost costs routing quality only."""
        for event in events:
            try:
                await self.bus.publish(self.subject, self.to_message(event))
            except Exception as e:
                log.warning("kv event not published", error=str(e), kind=event.kind)
