"""Feeds the KV index from the JetStream stream of KV events: history first, then live.

At start the router makes sure the stream exists (libs/common/kv_events.ensure_kv_stream),
notes its last sequence number, and reads it from the first kept event with an ordered
consumer (in order, no acks, recreated by nats-py after a gap). `replayed` turns true
when the consumer has passed the sequence noted at start: from then on the index is as
good as that of a router that never restarted (within the stream's age and size limits).

After a reconnect to NATS the feed subscribes again (the server may have restarted and
lost its consumers, or the stream itself): from the event after the last one applied when
the stream is the same one, from its start when it is a new stream (another creation
time: the events it holds were all published after the old one was lost).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import datetime

from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext

from libs.common.bus.connection import Bus
from libs.common.bus.kv_events import STREAM_NAME, ensure_kv_stream, events_subject, retry
from libs.common.log import get_logger
from libs.common.messages.control import KvEvent, MessageError
from services.router.routing.kv_index import KvIndex

log = get_logger(__name__)


class KvFeed:
    """Stream -> KvIndex. `start()` subscribes; `stop()` unsubscribes (safe twice)."""

    def __init__(self, bus: Bus, prefix: str, index: KvIndex, max_age: float, max_mb: int):
        self.bus, self.prefix, self.index = bus, prefix, index
        self.max_age, self.max_mb = max_age, max_mb
        self.stream = STREAM_NAME if prefix == "tandem" else f"{STREAM_NAME}_{prefix.upper()}"
        self.applied = 0
        self.replay_target = 0
        self.done = asyncio.Event()
        self.last_seq = 0  # stream sequence of the last event applied
        # The stream's creation time: a new stream has another.
        self._created: datetime | None = None
        self._sub: JetStreamContext.PushSubscription | None = None
        self._stopped = False

    @property
    def replayed(self) -> bool:
        return self.done.is_set()

    async def start(self) -> None:
        await ensure_kv_stream(self.bus, self.prefix, self.max_age, self.max_mb << 20)
        js = self.bus.nc.jetstream()
        info = await js.stream_info(self.stream)
        self._created = info.created
        self.replay_target = info.state.last_seq if info.state.messages else 0
        if self.replay_target == 0:
            self.done.set()
        self._sub = await self._subscribe(DeliverPolicy.ALL)
        self.bus.on_reconnect(self._resume)
        log.info("kv index replaying", stream=self.stream, up_to=self.replay_target)

    async def _subscribe(
        self, policy: DeliverPolicy, start_seq: int | None = None
    ) -> JetStreamContext.PushSubscription:
        config = ConsumerConfig(deliver_policy=policy, opt_start_seq=start_seq)
        return await self.bus.nc.jetstream().subscribe(
            events_subject(self.prefix), cb=self._on_msg, ordered_consumer=True, config=config
        )

    async def _resume(self) -> None:
        """After a reconnect: the stream again (if lost), and a new consumer on it."""

        async def step() -> None:
            await ensure_kv_stream(self.bus, self.prefix, self.max_age, self.max_mb << 20)
            info = await self.bus.nc.jetstream().stream_info(self.stream)
            old, self._sub = self._sub, None
            if old is not None:
                await _quietly(old.unsubscribe())
            if self._stopped:
                return
            same = info.created == self._created and info.state.last_seq >= self.last_seq
            self._created = info.created
            if same:
                start = max(self.last_seq + 1, info.state.first_seq)
                self._sub = await self._subscribe(DeliverPolicy.BY_START_SEQUENCE, start)
            else:
                self.last_seq = 0
                self._sub = await self._subscribe(DeliverPolicy.ALL)
            self.done.set()  # what was lost with the old stream is not coming back
            log.info("kv feed resumed", stream=self.stream, same_stream=same,
                     from_seq=self.last_seq + 1 if same else 1)  # fmt: skip

        await retry(step, "kv feed")

    async def _on_msg(self, msg: Msg) -> None:
        try:
            self.index.apply(KvEvent.decode(msg.data))
            self.applied += 1
        except MessageError as e:
            log.warning("unreadable kv event dropped", subject=msg.subject, error=str(e))
        try:
            seq = msg.metadata.sequence.stream
        except Exception:  # not a JetStream delivery: cannot tell
            return
        self.last_seq = max(self.last_seq, seq)
        if not self.done.is_set():
            if seq >= self.replay_target:
                self.done.set()
                log.info("kv index replayed", events=self.applied, keys=len(self.index))

    async def stop(self) -> None:
        self._stopped = True
        sub, self._sub = self._sub, None
        if sub is not None:
            await _quietly(sub.unsubscribe())


async def _quietly(awaitable: Awaitable[object]) -> None:
    try:
        await asyncio.wait_for(awaitable, timeout=2)
    except Exception as e:  # a closed connection already dropped it
        log.debug("kv feed unsubscribe failed", error=str(e))
