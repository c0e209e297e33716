"""One leader among the cache masters, elected through a JetStream key-value bucket.

The bucket (`election_bucket(prefix)`, one history entry per key, file storage) holds one
key, `leader`, whose value is a claim: the leader's master id and epoch. JetStream
gives every write a revision and refuses a write whose expected last revision is not
the key's current one; that compare-and-set is the whole election:

- The leader renews its claim every `lease / 3` seconds (an update at its revision).
- A standby reads the key every `lease / 10` seconds and notes when its revision last
  changed. It claims (an update at the revision it read, or a create where there is no
  key) when the claim has not changed for `lease` seconds (the leader died or cannot
  reach JetStream), when the claim was released (a leader's graceful stop), when the
  claim is its own and missed a renewal (`lease / 2`: this instance restarted; a claim of
  its own id that is renewed is a misconfigured duplicate, logged), or at its start when
  there is no claim.
  Of standbys that claim at once, one write lands; the others fail the compare-and-set.
- The winner's epoch is above the claim it replaced (`max(clock epoch, previous + 1)`),
  so stores, which follow the highest epoch they have seen, refuse the old leader
  (epoch.py) even if it comes back.
- A leader that finds another claim on the key is deposed (`on_deposed`). A leader that
  cannot reach JetStream keeps serving: no standby can claim without JetStream either,
  and a standby that did is announced on the bus and fences it through the stores.
- A key or bucket that vanished (a nats-server restarted without its JetStream store) is
  written again by the leader with its own claim at its next renewal.

Why a polled key rather than a bucket TTL and a watch: the age of a claim is measured on
the standby's own monotonic clock, so it needs no server-side per-key TTL and no clock
agreement between hosts; a `get` a few times a second is cheap, and it has no ordered
consumer to re-create after a reconnect.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from nats.js.api import StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

from libs.common.bus.connection import Bus
from libs.common.log import get_logger
from services.cache_master.ha.epoch import pick_epoch

log = get_logger(__name__)

KEY = "leader"


@dataclass(frozen=True)
class Claim:
    """The value of the leader key. `master_id == ""`: released by a graceful stop."""

    master_id: str
    epoch: int

    def encode(self) -> bytes:
        return orjson.dumps({"v": 1, "master_id": self.master_id, "epoch": self.epoch})

    @classmethod
    def decode(cls, data: bytes) -> Claim:
        """A value that is not a claim counts as released (it is overwritten)."""
        try:
            raw = orjson.loads(data)
            return cls(str(raw["master_id"]), int(raw["epoch"]))
        except (ValueError, KeyError, TypeError):
            return cls("", 0)


@dataclass(frozen=True)
class Seen:
    """The key as read: its revision (0: no key) and claim."""

    revision: int = 0
    claim: Claim | None = None


async def open_bucket(bus: Bus, bucket: str, timeout: float) -> Any:
    """The masters' bucket (the leader key; the saved pins, pins/saved.py), created when
    missing: two masters creating it with one config both succeed."""
    js = bus.nc.jetstream(timeout=timeout)
    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        return await js.create_key_value(
            bucket=bucket, history=1, storage=StorageType.FILE,
            description="Tandem cache master leader",
        )  # fmt: skip


class LeaderElection:
    """Claims and holds the leader key; `on_elected(epoch)` when this master wins,
    `on_deposed(claim)` when another holds the key (then this object stops)."""

    def __init__(self, bus: Bus, bucket: str, master_id: str, lease: float):
        self.bus, self.bucket, self.master_id, self.lease = bus, bucket, master_id, lease
        self.on_elected: Callable[[int], Awaitable[None]] | None = None
        self.on_deposed: Callable[[Claim | None], None] | None = None
        self.claim: Claim | None = None  # ours, while leading
        self.revision = 0
        self._kv: Any = None
        self._seen: Seen | None = None
        self._changed_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._failures = 0
        self._warned = False  # a live duplicate of our id was logged

    @property
    def leading(self) -> bool:
        return self._ours() is not None

    def _ours(self) -> Claim | None:
        """Our claim while leading, else None."""
        claim = self.claim
        return claim if claim is not None and claim.master_id == self.master_id else None

    async def start(self) -> None:
        """Look at the key once (a master that can win at once leads when this returns),
        then keep looking, or renewing, in a task."""
        await self._attempt()
        self._task = asyncio.create_task(self._run(), name="leader-election")

    async def stop(self) -> None:
        """Stop; a leader releases its claim so a standby takes over at once."""
        self.abandon()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        ours = self._ours()
        if ours is not None and self._kv is not None:
            released = Claim("", ours.epoch)
            try:
                await asyncio.wait_for(self._kv.update(KEY, released.encode(), last=self.revision),
                                       timeout=2)  # fmt: skip
                log.info("leadership released", epoch=ours.epoch)
            except Exception as e:  # the claim lapses after the lease instead
                log.warning("leadership release failed", error=str(e) or type(e).__name__)
        self.claim = None

    def abandon(self) -> None:
        """Stop claiming and renewing now (fenced: the claim is no longer ours to keep)."""
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.lease / 3 if self.leading else self.lease / 10)
            if not await self._attempt():
                return

    async def _attempt(self) -> bool:
        """One step; False once deposed. JetStream away or slow: open the bucket again."""
        try:
            if self._kv is None:
                await self._open()
            if not await self._step():
                return False
            self._failures = 0
        except Exception as e:
            if self._failures == 0:
                log.warning("leader key unreachable; retrying",
                            error=str(e) or type(e).__name__)  # fmt: skip
            self._failures += 1
            self._kv = None
        return True

    async def _open(self) -> None:
        self._kv = await open_bucket(self.bus, self.bucket, max(self.lease / 2, 0.5))

    async def _read(self) -> Seen:
        try:
            entry = await self._kv.get(KEY)
        except KeyNotFoundError:  # never written, or the stream is new
            return Seen()
        return Seen(entry.revision, Claim.decode(entry.value or b""))

    async def _step(self) -> bool:
        """One renewal or one look at the key; False once deposed."""
        ours = self._ours()
        if ours is not None:
            return await self._renew(ours)
        last = self._seen
        seen, now = await self._read(), time.monotonic()
        if last is None or seen.revision != last.revision:
            self._seen, self._changed_at = seen, now
        if self._may_claim(seen, last is None, now - self._changed_at):
            await self._claim(seen, now)
        return True

    def _may_claim(self, seen: Seen, first: bool, unchanged_for: float) -> bool:
        if seen.claim is None:
            return first or unchanged_for >= self.lease
        if seen.claim.master_id == "":
            return True  # released
        if seen.claim.master_id == self.master_id:
            # This id's earlier process (a restart) once it missed a renewal. A claim of
            # ours that keeps being renewed is another live master with our id: wait.
            if not first and unchanged_for == 0.0 and not self._warned:
                self._warned = True
                log.error("another live master uses this service id; standing by",
                          master=self.master_id[:80])  # fmt: skip
            return unchanged_for >= self.lease / 2
        return unchanged_for >= self.lease

    async def _claim(self, seen: Seen, now: float) -> None:
        previous = seen.claim.epoch if seen.claim is not None else 0
        claim = Claim(self.master_id, max(pick_epoch(), previous + 1))
        try:
            if seen.revision:
                revision = await self._kv.update(KEY, claim.encode(), last=seen.revision)
            else:
                revision = await self._kv.create(KEY, claim.encode())
        except KeyWrongLastSequenceError:
            log.info("another master claimed the leadership first")
            return
        self.claim, self.revision = claim, revision
        log.info("elected pool master leader", epoch=claim.epoch, previous_epoch=previous,
                 previous_leader=seen.claim.master_id[:80] if seen.claim else "",
                 unchanged_for=round(now - self._changed_at, 3))  # fmt: skip
        if self.on_elected is not None:
            await self.on_elected(claim.epoch)

    async def _renew(self, claim: Claim) -> bool:
        """Renew `claim` (ours: `self.claim`); False once another master holds the key."""
        try:
            self.revision = await self._kv.update(KEY, claim.encode(), last=self.revision)
            return True
        except KeyWrongLastSequenceError:
            pass  # someone wrote the key, or our last write landed unacknowledged
        seen = await self._read()
        if seen.claim == claim:
            self.revision = seen.revision  # ours: renewed at the next step
            return True
        if seen.claim is None:  # the key or the bucket was lost: the claim is still ours
            self.revision = await self._kv.create(KEY, claim.encode())
            log.warning("leader key was gone; claimed again", epoch=claim.epoch)
            return True
        log.error("another master holds the leadership; stepping down",
                  epoch=claim.epoch, leader=seen.claim.master_id[:80],
                  leader_epoch=seen.claim.epoch)  # fmt: skip
        self.claim = None
        if self.on_deposed is not None:
            self.on_deposed(seen.claim)
        return False
