"""The token streams of one router: two subscriptions for all its requests, a dict of sinks.

    <prefix>.stream.<router-id>.<rid>   TokenChunk (a prefill worker's token 0; any worker
                                        that does not batch)
    <prefix>.chunks.<router-id>         TokenChunkBatch (a decode worker's step, all of this
                                        router's requests on that worker in one message)

Both are subscribed once, at the first request, instead of a SUB and an UNSUB per request
(each a protocol line to the server and a subscription task in nats-py, whose wake-up per
chunk was a good part of the per-token cost at 64 streams). Chunks are decoded here, in the
subscription's callback, and handed to the request's sink right there (a plain call: the
router formats and writes the client's SSE event inside it, services/router/dispatch/dispatcher.py);
a chunk for a request that is no longer open (it ended, or a late chunk after a cancel)
is dropped. A sink must not raise: what it cannot handle ends its own request, never the
callback that serves every other stream.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from nats.aio.msg import Msg

from libs.common.bus.connection import Bus, settle
from libs.common.log import get_logger
from libs.common.messages.control import MessageError, TokenChunk, TokenChunkBatch

log = get_logger(__name__)

Sink = Callable[[TokenChunk], None]


class StreamTable:
    """`open(rid, sink)` -> (wire id, subject); `close(wire id)` when the request ends."""

    def __init__(self, bus: Bus, prefix: str, router_id: str):
        self.bus = bus
        self.stream_prefix = f"{prefix}.stream.{router_id}."
        self.batch_subject = f"{prefix}.chunks.{router_id}"
        self._sinks: dict[str, Sink] = {}
        self._subs: list = []
        self._starting: asyncio.Lock = asyncio.Lock()
        self._dupes = itertools.count(1)

    @property
    def ready(self) -> bool:
        """Subscribed: `start` returns at once."""
        return bool(self._subs)

    async def start(self) -> None:
        """Subscribe (once; later calls return at once). Settled (libs/common/bus): the
        server has the interest before the first GenerateRequest goes out, so no chunk is
        missed."""
        if self._subs:
            return
        async with self._starting:
            if self._subs:
                return
            nc = self.bus.nc
            subs = [
                await nc.subscribe(self.stream_prefix + "*", cb=self._on_chunk),
                await nc.subscribe(self.batch_subject, cb=self._on_batch),
            ]
            await settle(nc)
            self._subs = subs

    def open(self, rid: str, sink: Sink) -> tuple[str, str]:
        """`sink` gets `rid`'s chunks; returns (wire id, stream subject). The wire id is
        `rid` unless a request with that id is already open here: then `rid-d<n>`, so the
        two never read each other's tokens. The router's ids are its own counter (the
        client's x-request-id is only a label), so this is a guard, not a path."""
        wire = rid
        while wire in self._sinks:
            wire = f"{rid}-d{next(self._dupes)}"
        self._sinks[wire] = sink
        return wire, self.stream_prefix + wire

    def close(self, wire: str) -> None:
        self._sinks.pop(wire, None)

    def __len__(self) -> int:
        return len(self._sinks)

    async def stop(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            try:
                await sub.unsubscribe()
            except Exception as e:  # the connection may already be closed
                log.debug("stream subscription not removed", error=str(e))

    async def _on_chunk(self, msg: Msg) -> None:
        sink = self._sinks.get(msg.subject[len(self.stream_prefix) :])
        if sink is None:
            return  # the request ended: a late chunk
        try:
            chunk = TokenChunk.decode(msg.data)
        except MessageError as e:
            log.warning("unreadable token chunk dropped", error=str(e))
            return
        sink(chunk)

    async def _on_batch(self, msg: Msg) -> None:
        try:
            batch = TokenChunkBatch.decode(msg.data)
        except MessageError as e:
            log.warning("unreadable token chunk batch dropped", error=str(e))
            return
        sinks = self._sinks
        for chunk in batch.chunks:
            sink = sinks.get(chunk.request_id)
            if sink is not None:
                sink(chunk)
