"""One leader among the cache masters, elected through a JetStream key-value bucket.

The bucket (`election_bucket(prefix)`, one history entry per key, file storage) holds one
key, `leader`, whose value is a claim: the leader's master id and epoch. JetStream
gives every write a revision and refuses a write whose expected last revision is not
the key's current one; that compare-and-set is the whole election:

- The leader renews its claim every `lease / 10` seconds (an update at its revision). Its
  lease runs, on its own monotonic clock, from the moment it *sent* its last renewal that
  JetStream acknowledged: a renewal that fails (JetStream away, paused, slow) is retried
  every `lease / 25` seconds and costs nothing while the lease lasts; a leader whose lease
  runs out unrenewed lapses (`on_lapsed`: it serves nothing, and a request that reaches it
  after the expiry is refused before it is served, `check_lease`) and keeps renewing: a
  renewal that lands at its own revision (nobody claimed meanwhile) resumes it with the
  same epoch and metadata (`on_resumed`: a nats-server restart does not cost a lone
  master its pool); another claim on the key deposes it.
- A standby reads the key every `lease / 10` seconds and notes when its revision last
  changed. It claims (an update at the revision it read, or a create where there is no
  key) when the claim has not changed for `lease` seconds (the leader died or cannot
  reach JetStream), when the claim was released (a leader's graceful stop), when the
  claim is its own and missed a renewal (`lease / 2`: this instance restarted; a claim of
  its own id that is renewed is a misconfigured duplicate, logged), or at its start when
  there is no claim.
  Of standbys that claim at once, one write lands; the others fail the compare-and-set.
- No split brain: a standby first sees a revision after the leader sent it, so the
  standby's `lease` from that sight ends after the leader's lease from its send: the
  leader has stepped down before any standby may claim. An outage of JetStream shorter
  than the lease (less a renewal interval) leaves the leader leading with its epoch; a
  longer one hands the pool to whichever master claims first once JetStream is back,
  with a higher epoch (the lapsed leader's renewal at its old revision then fails).
- The winner's epoch is above the claim it replaced (`max(clock epoch, previous + 1)`),
  so stores, which follow the highest epoch they have seen, refuse the old leader
  (epoch.py) even if it comes back.
- A leader that finds another claim on the key is deposed (`on_deposed`).
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
RENEWALS_PER_LEASE = 10  # the leader's renewals, and a standby's reads, per lease
RETRIES_PER_LEASE = 25  # a leader's retries per lease while a renewal fails
# The bucket's bounds (`--election-bucket-bytes` for the whole): one value at most one NATS
# message at nats-server's default max_payload (1 MiB); a saved pin of MAX_PIN_KEYS keys
# is ~300 KB (pins/saved.py) and a claim ~100 bytes (MAX_CLAIM: a longer leader value is
# not a claim and counts as released).
MAX_VALUE = 1 << 20
MAX_CLAIM = 1024


class ValueTooLarge(ValueError):
    """A value above the bucket's bound: refused before it is sent."""


def check_value(key: str, data: bytes) -> bytes:
    if len(data) > MAX_VALUE:
        raise ValueTooLarge(f"{key}: {len(data)} bytes, above the bucket's bound of "
                            f"{MAX_VALUE} bytes per value")  # fmt: skip
    return data


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
        if len(data) > MAX_CLAIM:
            return cls("", 0)
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


async def open_bucket(
    bus: Bus, bucket: str, timeout: float, max_bytes: int, check_bounds: bool = False
) -> Any:
    """The masters' bucket (the leader key; the saved pins, pins/saved.py), created when
    missing with its bounds: at most `max_bytes` in all, MAX_VALUE per value, one history
    entry per key (two masters creating it with one config both succeed). A bucket made
    without bounds (by a master before them) is used as it is, with a warning: the
    masters may not change its stream (libs/common/bus/permissions.py)."""
    js = bus.nc.jetstream(timeout=timeout)
    try:
        kv = await js.key_value(bucket)
    except BucketNotFoundError:
        return await js.create_key_value(
            bucket=bucket, history=1, storage=StorageType.FILE, max_bytes=max_bytes,
            max_value_size=MAX_VALUE, description="Tandem cache master leader",
        )  # fmt: skip
    if not check_bounds:
        return kv
    config = (await kv.status()).stream_info.config
    if (config.max_bytes or -1) < 0 or (config.max_msg_size or -1) < 0:
        log.warning("the masters' bucket has no size bound (made before the bounds); "
                    "delete it while no master runs to have it made again with them",
                    bucket=bucket)  # fmt: skip
    return kv


class LeaderElection:
    """Claims and holds the leader key; `on_elected(epoch)` when this master wins,
    `on_deposed(claim)` when another holds the key (then this object stops)."""

    def __init__(self, bus: Bus, bucket: str, master_id: str, lease: float,
                 max_bytes: int = 64 << 20):  # fmt: skip
        self.bus, self.bucket, self.master_id, self.lease = bus, bucket, master_id, lease
        self.max_bytes = max_bytes
        self.expires = 0.0  # while leading: the monotonic end of our lease
        self.on_elected: Callable[[int], Awaitable[None]] | None = None
        self.on_deposed: Callable[[Claim | None], None] | None = None
        self.lapsed = False  # our lease ran out unrenewed: serve nothing until renewed
        self.on_lapsed: Callable[[], None] | None = None
        self.on_resumed: Callable[[], None] | None = None
        self.claim: Claim | None = None  # ours, while leading
        self.revision = 0
        self._kv: Any = None
        self._seen: Seen | None = None
        self._changed_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._abandoned = False  # stop claiming (a cancel alone can be lost: see _run)
        self._failures = 0  # JetStream calls failed in a row
        self._opened = False  # the bucket's bounds were checked (the first open)
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
        self._abandoned = True
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()

    def check_lease(self) -> bool:
        """Whether this leader may serve now: False once its lease ran out unrenewed (it
        lapses now, before it serves a request that reached it late: the election task
        may be late on a busy loop), until a renewal lands again."""
        if self._ours() is not None and not self.lapsed and time.monotonic() >= self.expires:
            self._lapse()
        return not self.lapsed

    def _lapse(self) -> None:
        """Our lease ran out unrenewed: serve nothing until a renewal of our claim lands
        (nobody else claimed meanwhile: the metadata is still the pool's, and nothing
        was served without a lease) or another claim is found (deposed)."""
        late = time.monotonic() - self.expires
        log.error("leader lease expired unrenewed (JetStream unreachable); not serving "
                  "until it is renewed", epoch=self.claim.epoch if self.claim else 0,
                  lease=self.lease, late=round(late, 3), failures=self._failures)  # fmt: skip
        self.lapsed = True
        if self.on_lapsed is not None:
            self.on_lapsed()

    def _resume(self) -> None:
        self.lapsed = False
        log.info("leader lease renewed after it lapsed; serving again",
                 epoch=self.claim.epoch if self.claim else 0)  # fmt: skip
        if self.on_resumed is not None:
            self.on_resumed()

    def _pause(self) -> float:
        """A leader renews every lease / 10, and retries a failed renewal every lease / 25
        (never past its lease); a standby reads every lease / 10."""
        if self._ours() is None or not (self._failures or self.lapsed):
            return self.lease / RENEWALS_PER_LEASE
        if self.lapsed:
            return self.lease / RETRIES_PER_LEASE
        return min(self.lease / RETRIES_PER_LEASE, max(0.0, self.expires - time.monotonic()))

    async def _run(self) -> None:
        # The flag, not the cancel alone, ends the loop: on Python 3.11 asyncio.wait_for
        # returns its result when the cancel lands as the awaited call completes, and the
        # cancel is lost (a master's stop then waited forever; fixed in 3.12).
        while not self._abandoned:
            await asyncio.sleep(self._pause())
            if not await self._attempt():
                return

    async def _attempt(self) -> bool:
        """One step; False once deposed, or once our lease ran out. A leader's step ends by
        its lease's end at the latest. JetStream away: the bucket is opened again (a
        timeout keeps it: the bucket is there, JetStream is slow or away)."""
        try:
            if self._ours() is not None:
                left = self.expires - time.monotonic()
                if left <= 0 and not self.lapsed:
                    self._lapse()
                budget = self._timeout if self.lapsed else min(left, self._timeout)
                done = await asyncio.wait_for(self._step(), timeout=budget)
            else:
                done = await self._step()
            if not done:
                return False
            self._failures = 0
            if self.lapsed and self._ours() is not None and time.monotonic() < self.expires:
                self._resume()
        except Exception as e:
            if self._failures == 0:
                log.warning("leader key unreachable; retrying",
                            error=str(e) or type(e).__name__)  # fmt: skip
            self._failures += 1
            if not isinstance(e, TimeoutError):
                self._kv = None
        if self._ours() is not None and not self.lapsed and time.monotonic() >= self.expires:
            self._lapse()
        return True

    @property
    def _timeout(self) -> float:
        """Of one JetStream call: a fifth of the lease (0.5 s by default), at least 0.25 s."""
        return max(self.lease / 5, 0.25)

    async def _step(self) -> bool:
        """One renewal or one look at the key (the bucket opened first); False once deposed."""
        if self._kv is None:
            self._kv = await open_bucket(self.bus, self.bucket, self._timeout, self.max_bytes,
                                         check_bounds=not self._opened)  # fmt: skip
            self._opened = True
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

    async def _read(self) -> Seen:
        try:
            entry = await self._kv.get(KEY)
        except KeyNotFoundError:  # never written, or the stream is new
            return Seen()
        return Seen(entry.revision, Claim.decode(entry.value or b""))

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
        sent = time.monotonic()  # our lease runs from here, if this write lands
        try:
            if seen.revision:
                revision = await self._kv.update(KEY, claim.encode(), last=seen.revision)
            else:
                revision = await self._kv.create(KEY, claim.encode())
        except KeyWrongLastSequenceError:
            log.info("another master claimed the leadership first")
            return
        self.claim, self.revision, self.expires = claim, revision, sent + self.lease
        log.info("elected pool master leader", epoch=claim.epoch, previous_epoch=previous,
                 previous_leader=seen.claim.master_id[:80] if seen.claim else "",
                 unchanged_for=round(now - self._changed_at, 3))  # fmt: skip
        if self.on_elected is not None:
            await self.on_elected(claim.epoch)

    async def _renew(self, claim: Claim) -> bool:
        """Renew `claim` (ours: `self.claim`); our lease then runs from the moment the
        renewal was sent. False once another master holds the key."""
        for _ in range(2):
            sent = time.monotonic()
            try:
                self.revision = await self._kv.update(KEY, claim.encode(), last=self.revision)
                self.expires = sent + self.lease
                return True
            except KeyWrongLastSequenceError:
                pass  # someone wrote the key, or our last write landed unacknowledged
            seen = await self._read()
            if seen.claim == claim:
                self.revision = seen.revision  # ours: renewed again at once, at it
                continue
            if seen.claim is None:  # the key or the bucket was lost: the claim is still ours
                sent = time.monotonic()
                self.revision = await self._kv.create(KEY, claim.encode())
                self.expires = sent + self.lease
                log.warning("leader key was gone; claimed again", epoch=claim.epoch)
                return True
            log.error("another master holds the leadership; stepping down",
                      epoch=claim.epoch, leader=seen.claim.master_id[:80],
                      leader_epoch=seen.claim.epoch)  # fmt: skip
            self.claim = None
            if self.on_deposed is not None:
                self.on_deposed(seen.claim)
            return False
        raise RuntimeError("the leader key moved under our renewals twice")
