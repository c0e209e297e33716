"""Feeds the KV index from the JetStream stream of KV events: history first, then live.

At start the router makes sure the stream exists (libs/common/kv_events.ensure_kv_stream),
notes its last sequence number, and reads it from the first kept event with an ordered
consumer (in order, no acks, recreated by nats-py after a gap). `replayed` turns true
when the consumer has passed the sequence noted at start: from then on the index is as
good as that of a router that never restarted (within the stream's age and size limits).
"""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from libs.common.bus import Bus
from libs.common.kv_events import STREAM_NAME, ensure_kv_stream, events_subject
from libs.common.log import get_logger
from libs.common.messages import KvEvent, MessageError
from services.router.kv_index import KvIndex

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
        self._sub = None

    @property
    def replayed(self) -> bool:
        return self.done.is_set()

    async def start(self) -> None:
        await ensure_kv_stream(self.bus, self.prefix, self.max_age, self.max_mb << 20)
        js = self.bus.nc.jetstream()
        info = await js.stream_info(self.stream)
        self.replay_target = info.state.last_seq if info.state.messages else 0
        if self.replay_target == 0:
            self.done.set()
        self._sub = await js.subscribe(
            events_subject(self.prefix),
            cb=self._on_msg,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )
        log.info("kv index replaying", stream=self.stream, up_to=self.replay_target)

    async def _on_msg(self, msg: Msg) -> None:
        try:
            self.index.apply(KvEvent.decode(msg.data))
            self.applied += 1
        except MessageError as e:
            log.warning("unreadable kv event dropped", subject=msg.subject, error=str(e))
        if not self.done.is_set():
            try:
                seq = msg.metadata.sequence.stream
            except Exception:  # not a JetStream delivery: cannot tell; keep waiting
                return
            if seq >= self.replay_target:
                self.done.set()
                log.info("kv index replayed", events=self.applied, keys=len(self.index))

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await asyncio.wait_for(sub.unsubscribe(), timeout=2)
            except Exception as e:  # a closed connection already dropped it
                log.debug("kv feed unsubscribe failed", error=str(e))
