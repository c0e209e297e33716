"""The master's epoch: a number that fences a stale or second master.

Each master serves with one epoch, picked at start (`--epoch`, or from the clock) and
never lowered. Stores remember the highest epoch they have seen and send it with every
request; they take index updates, mount replies and copy orders only from that epoch.
A master that learns of a higher epoch (a store's request, or another master's
announcement on `tandem.pool.master.epoch`) is stale: it stops serving at once and
stays stopped, so two masters never allocate in the same store. Without election the
newest master wins. Issue 26's election through JetStream KV can set the epoch instead
(`--epoch`, or `CacheMasterService.epoch` before start): any scheme works as long as a
new leader's epoch is above every earlier one's.
"""

from __future__ import annotations

import secrets
import time

from libs.common.messages.pool import EPOCH_RANDOM_BITS, epoch_ceiling

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
