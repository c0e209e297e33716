"""The master's epoch: a number that fences a stale or second master.

Each master serves with one epoch, picked at start (`--epoch`, or from the clock) and
never lowered. Stores remember the highest epoch they have seen and send it with every
request; they take index updates, mount replies and copy orders only from that epoch.
A master that learns of a higher epoch (a store's request, or another master's
announcement on `tandem.pool.master.epoch`) is stale: it stops serving at once and
stays stopped, so two masters never allocate in the same store. Without election the
newest master wins. Issue 26's election through JetStream KV can set the epoch instead
(`--epoch`, or `MasterEpoch.value` before start): any scheme works as long as a
new leader's epoch is above every earlier one's.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from libs.common.bus.connection import Bus, HandlerError
from libs.common.log import get_logger
from libs.common.messages.pool import EPOCH_RANDOM_BITS, PoolMasterEpoch, epoch_ceiling

log = get_logger(__name__)

RANDOM_BITS = EPOCH_RANDOM_BITS


def pick_epoch(configured: int = 0, now_ns: int | None = None) -> int:
    """`configured` if set, else milliseconds since 1970 shifted left 16 bits, plus 16
    random bits: above any epoch picked in an earlier millisecond (clocks permitting),
    and two masters started in the same millisecond still differ (65,535 to 1)."""
    if configured > 0:
        return configured
    ms = (time.time_ns() if now_ns is None else now_ns) // 1_000_000
    return (ms << RANDOM_BITS) | secrets.randbits(RANDOM_BITS)


def plausible(epoch: int) -> bool:
    """Not above what the clock allows a day from now (messages/pool.py)."""
    return epoch <= epoch_ceiling(time.time_ns())


def outranks(epoch: int, master_id: str, other_epoch: int, other_id: str) -> bool:
    """Does (other_epoch, other_id) win over (epoch, master_id)? Ties go to the larger id."""
    return (other_epoch, other_id) > (epoch, master_id)


class MasterEpoch:
    """This master's epoch on the bus: announced, compared, and the fence when outranked.

    `on_fenced()` runs once, when a higher epoch is heard; the service then stops serving.
    """

    def __init__(self, bus: Bus, subject: str, master_id: str, on_fenced: Callable[[], None]):
        self.bus, self.subject, self.master_id, self.on_fenced = bus, subject, master_id, on_fenced
        self.value = 0  # set before start() to impose one (a flag, an election)
        self.fenced_by = 0  # the higher epoch that fenced this master
        self._sub: Any = None

    async def start(self) -> None:
        self.value = pick_epoch(self.value)
        self._sub = await self.bus.subscribe(self.subject, self._on_announcement)
        await self.announce()

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as e:  # closed connection: nothing to unsubscribe from
                log.debug("unsubscribe failed", error=str(e))

    async def announce(self) -> None:
        try:
            await self.bus.publish(self.subject, PoolMasterEpoch(self.value, self.master_id))
        except Exception as e:  # the next sweep announces again
            log.warning("epoch announcement failed", error=str(e))

    async def _on_announcement(self, msg: Any) -> None:
        try:
            other = PoolMasterEpoch.decode(msg.data)
        except ValueError as e:
            log.warning("bad epoch announcement ignored", error=str(e))
            return
        if (other.epoch, other.master_id) == (self.value, self.master_id):
            return  # our own
        if not plausible(other.epoch):
            log.warning("implausible epoch announcement ignored", epoch=other.epoch,
                        master=other.master_id[:80])  # fmt: skip
        elif outranks(self.value, self.master_id, other.epoch, other.master_id):
            self.fence(other.epoch, f"master {other.master_id[:80]!r}")
        elif not self.fenced_by:
            await self.announce()  # so the stale one learns

    def seen(self, epoch: int, store_id: str) -> None:
        """A store has seen `epoch`: above ours, this master is stale (409 from now on)."""
        if not plausible(epoch):
            raise HandlerError(400, f"epoch {epoch}: above what the clock allows; refused")
        if epoch > self.value:
            self.fence(epoch, f"store {store_id[:80]!r}")
        self.check()

    def check(self) -> None:
        if self.fenced_by:
            raise HandlerError(409, f"master epoch {self.value} is stale: epoch "
                               f"{self.fenced_by} serves the pool")  # fmt: skip

    def fence(self, epoch: int, by: str) -> None:
        if self.fenced_by:  # fenced already: keep the highest epoch heard (for `info`)
            self.fenced_by = max(self.fenced_by, epoch)
            return
        self.fenced_by = epoch
        log.error("a master with a higher epoch exists; this one stops serving (restart it "
                  "to take over)", epoch=self.value, higher=epoch, seen_from=by)  # fmt: skip
        self.on_fenced()
