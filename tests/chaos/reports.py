"""What the services report: load reports (free pages), `info`, the pool's KV events."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from libs.common.bus.connection import Bus
from libs.common.messages.control import InfoRequest, KvEvent, LoadReport, ServiceInfo


async def connect(url: str, name: str) -> Bus:
    bus = Bus(url, name, connect_timeout=10, request_timeout=5)
    await bus.connect()
    return bus


async def free_pages(bus: Bus, worker: str, want: int | None = None, timeout: float = 10):
    """Free pages (free + evictable cached) from `worker`'s load reports: the next one, or
    with `want`, the first report showing it (the last seen when none does in time)."""
    seen: list[int] = []
    matched = asyncio.Event()

    async def on_load(msg) -> None:
        seen.append(LoadReport.decode(msg.data).free_pages)
        if want is None or seen[-1] == want:
            matched.set()

    sub = await bus.subscribe(f"tandem.workers.*.{worker}.load", on_load)
    try:
        await asyncio.wait_for(matched.wait(), timeout)
    except TimeoutError:
        pass
    finally:
        await sub.unsubscribe()
    if not seen:
        raise AssertionError(f"{worker} sent no load report within {timeout}s")
    return seen[-1]


async def info(bus: Bus, service: str, sid: str) -> dict:
    reply = await bus.request(f"tandem.{service}.{sid}.info", InfoRequest(), ServiceInfo)
    return reply.details


class PoolWatch:
    """Keys the pool holds, per store, from the KV events (tier `pool`) seen since `start`."""

    def __init__(self, bus: Bus):
        self.bus = bus
        self.held: dict[str, set[str]] = {}
        self._changed = asyncio.Event()
        self._sub = None

    async def start(self) -> PoolWatch:
        self._sub = await self.bus.subscribe("tandem.kv.events.>", self._on_event)
        return self

    async def _on_event(self, msg) -> None:
        event = KvEvent.decode(msg.data)
        if event.tier != "pool":
            return
        keys = self.held.setdefault(event.source, set())
        if event.kind == "stored":
            keys.update(event.keys)
        elif event.kind == "removed":
            keys.difference_update(event.keys)
        elif event.kind == "cleared":
            keys.clear()
        self._changed.set()

    def keys(self) -> set[str]:
        return set().union(*self.held.values()) if self.held else set()

    async def wait_for(self, keys: Iterable[str], stores: Iterable[str], timeout: float = 30):
        """Until every key is held by every store in `stores`."""
        keys, stores = set(keys), list(stores)
        async with asyncio.timeout(timeout):
            while not all(keys <= self.held.get(s, set()) for s in stores):
                self._changed.clear()
                await self._changed.wait()

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
