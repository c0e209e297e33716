"""Soft pins saved where the election lives, so that a new leader keeps them.

The masters' JetStream KV bucket (ha/election.py, `election_bucket(prefix)`) holds, next to
the `leader` key:

    pins           PoolPinIndex: the ids of the saved pins
    pin.<pin_id>   PoolPinRecord: its keys, expiry (unix seconds), label

Only the leader writes them, and it acknowledges a pin (or an unpin) only once written.
A new leader reads the index and then each pin with plain gets (the same rights the
election uses: no consumer on the bucket, libs/common/bus/permissions.py), before it
serves. Expired pins are dropped when read and deleted at the sweep that expires them.
"""

from __future__ import annotations

from typing import Any

from nats.js.errors import KeyNotFoundError

from libs.common.bus.connection import Bus
from libs.common.log import get_logger
from libs.common.messages.pins import PoolPinIndex, PoolPinRecord
from services.cache_master.ha.election import check_value, open_bucket
from services.cache_master.pins.book import Pin

log = get_logger(__name__)

INDEX = "pins"


def pin_key(pin_id: str) -> str:
    return f"pin.{pin_id}"


class SavedPins:
    """Reads and writes the saved pins; every call raises on a JetStream failure."""

    def __init__(self, bus: Bus, bucket: str, max_bytes: int, timeout: float = 2.0):
        self.bus, self.bucket, self.timeout, self.max_bytes = bus, bucket, timeout, max_bytes
        self._kv: Any = None

    async def _bucket(self) -> Any:
        if self._kv is None:
            self._kv = await open_bucket(self.bus, self.bucket, self.timeout, self.max_bytes)
        return self._kv

    async def _call(self, op: str, *args: Any) -> Any:
        kv = await self._bucket()
        try:
            return await getattr(kv, op)(*args)
        except KeyNotFoundError:
            raise
        except Exception:
            self._kv = None  # open it again next time (JetStream restarted, the bucket lost)
            raise

    async def load(self, now: float) -> list[Pin]:
        """The saved pins that have not expired, oldest first."""
        try:
            entry = await self._call("get", INDEX)
        except KeyNotFoundError:
            return []
        ids = PoolPinIndex.decode(entry.value or b"{}").pin_ids
        pins: list[Pin] = []
        for pin_id in ids:
            try:
                record = PoolPinRecord.decode((await self._call("get", pin_key(pin_id))).value)
            except KeyNotFoundError:
                continue  # deleted after the index was written: gone
            if record.expires_at > now:
                pins.append(Pin(record.pin_id, tuple(record.keys), record.expires_at,
                                record.created_at, record.label, record.tokens))  # fmt: skip
        pins.sort(key=lambda p: p.created_at)
        return pins

    async def save(self, pin: Pin, ids: list[str]) -> None:
        """Write `pin`, then the index `ids` (which names it). A value above the bucket's
        bound (MAX_VALUE) raises ValueTooLarge before anything is written."""
        record = PoolPinRecord(pin.pin_id, list(pin.keys), pin.expires_at, pin.created_at,
                               pin.label, pin.tokens)  # fmt: skip
        index = check_value(INDEX, PoolPinIndex(ids).encode())
        await self._call("put", pin_key(pin.pin_id), check_value("pin", record.encode()))
        await self._call("put", INDEX, index)

    async def delete(self, pin_ids: list[str], ids: list[str]) -> None:
        """Write the index `ids` (without `pin_ids`), then delete those pins."""
        await self._call("put", INDEX, check_value(INDEX, PoolPinIndex(ids).encode()))
        for pin_id in pin_ids:
            await self._call("delete", pin_key(pin_id))
