"""The master's pin endpoints (`pin`, `unpin`, `pins`) over the pin book and the saved pins.

    pin     PoolPin -> PoolPinInfo: the book checks the bounds (400, 409), the pin is saved
            (elected masters: saved.py; 503 if it cannot be), then answered
    unpin   PoolPinRef -> PoolPinInfo of the pin removed (404 unknown)
    pins    PoolPinList -> PoolPinList: every live pin, held bytes and the bound

What the book holds is recomputed (`refresh`) after each change, after a mount and at every
sweep, which also expires pins; a put_end holds its pinned keys at once (`hold`). Pin and
unpin share a lock over the book's change and its save, so the bucket never keeps a pin the
leader has dropped. A leader that could not read the saved pins at its start answers pin and
unpin with 503 and reads them again at each sweep until it can: writing its own index
first would drop the saved pins from the bucket.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from libs.common.bus.connection import HandlerError
from libs.common.log import get_logger
from libs.common.messages.pins import PoolPin, PoolPinInfo, PoolPinList, PoolPinRef
from services.cache_master.ha.election import ValueTooLarge
from services.cache_master.metadata.metadata import PoolMetadata
from services.cache_master.metadata.objects import PoolRequestError
from services.cache_master.pins.book import Pin, PinBook, PinLimits
from services.cache_master.pins.saved import SavedPins

log = get_logger(__name__)


class Pinning:
    """Soft pins of one master; `store` (the saved pins) None: kept in memory only (no election)."""

    def __init__(self, meta: PoolMetadata, limits: PinLimits, store: SavedPins | None) -> None:
        self.meta, self.store = meta, store
        self.book = PinBook(limits)
        meta.keep = self.book.holds
        self.loaded = store is None
        self._lock = asyncio.Lock()

    async def load(self) -> None:
        """Read the saved pins (a new leader, before it serves); on failure, retried by
        `sweep`."""
        if self.loaded or self.store is None:
            return
        try:
            pins = await self.store.load(time.time())
        except Exception as e:
            log.warning("saved pins unreadable; pin and unpin wait for them",
                        error=str(e) or type(e).__name__)  # fmt: skip
            return
        async with self._lock:
            for pin in pins:
                if pin.pin_id not in self.book.pins:
                    self.book.restore(pin)
            self.loaded = True
            self.refresh()
        if pins:
            log.info("saved pins restored", pins=len(pins))

    def refresh(self) -> None:
        self.book.refresh(self.meta.objects, self.meta.segments)

    def hold(self, keys: Iterable[str]) -> None:
        """Keys made visible (put_end): hold the pinned ones within the bound."""
        for key in keys:
            if self.book.pinned(key):
                self.book.hold(self.meta.objects[key], self.meta.segments)

    async def sweep(self) -> None:
        await self.load()
        ended = self.book.expire(time.time())
        self.refresh()
        if not ended:
            return
        log.info("pins expired", pins=[p.pin_id for p in ended])
        if self.store is not None and self.loaded:
            async with self._lock:
                try:
                    await self.store.delete([p.pin_id for p in ended], list(self.book.pins))
                except Exception as e:  # read back by a new leader, and dropped as expired
                    log.warning("expired pins not deleted from the bucket", error=str(e))

    # --- endpoints ---------------------------------------------------------------------------

    async def pin(self, req: PoolPin) -> PoolPinInfo:
        self._ready()
        async with self._lock:
            before = {p.pin_id: p.expires_at for p in self.book.pins.values()}
            try:
                pin = self.book.add(req.keys, req.ttl_s, time.time(), self.meta.objects,
                                    self.meta.segments, label=req.label,
                                    tokens=req.tokens)  # fmt: skip
            except PoolRequestError as e:
                raise HandlerError(e.code, e.message) from None
            self.refresh()
            if self.store is not None:
                try:
                    await self.store.save(pin, list(self.book.pins))
                except ValueTooLarge as e:
                    self._undo(pin, before)
                    raise HandlerError(413, f"the pin cannot be saved: {e}") from None
                except Exception as e:
                    self._undo(pin, before)
                    raise HandlerError(503, f"the pin could not be saved (JetStream): "
                                       f"{str(e) or type(e).__name__}") from None  # fmt: skip
        log.info("pinned", pin=pin.pin_id, pages=len(pin.keys), label=pin.label[:80],
                 expires_at=pin.expires_at)  # fmt: skip
        return self.info(pin)

    def _undo(self, pin: Pin, before: dict[str, float]) -> None:
        if pin.pin_id in before:
            pin.expires_at = before[pin.pin_id]
        else:
            self.book.remove(pin.pin_id)
        self.refresh()

    async def unpin(self, req: PoolPinRef) -> PoolPinInfo:
        self._ready()
        async with self._lock:
            pin = self.book.pins.get(req.pin_id)
            if pin is None:
                raise HandlerError(404, f"no pin {req.pin_id[:80]!r}")
            info = self.info(pin)
            if self.store is not None:
                left = [i for i in self.book.pins if i != pin.pin_id]
                try:
                    await self.store.delete([pin.pin_id], left)
                except Exception as e:
                    raise HandlerError(503, f"the unpin could not be saved (JetStream): "
                                       f"{str(e) or type(e).__name__}") from None  # fmt: skip
            self.book.remove(pin.pin_id)
            self.refresh()
        log.info("unpinned", pin=pin.pin_id)
        return info

    async def pins(self, _req: PoolPinList) -> PoolPinList:
        segments = self.meta.segments.values()
        return PoolPinList([self.info(p) for p in self.book.pins.values()],
                           self.book.held_bytes(), self.book.budget(segments))  # fmt: skip

    def info(self, pin: Pin) -> PoolPinInfo:
        present, held, size = self.book.describe(pin, self.meta.objects)
        return PoolPinInfo(pin.pin_id, len(pin.keys), pin.expires_at, pin.created_at,
                           pin.label, pin.tokens, present, held, size)  # fmt: skip

    def _ready(self) -> None:
        if not self.loaded:
            raise HandlerError(503, "this leader has not read the saved pins yet; retry")
