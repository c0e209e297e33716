"""The token streams of one router: two subscriptions for all its requests, a dict of queues.

    <prefix>.stream.<router-id>.<rid>   TokenChunk (a prefill worker's token 0; any worker
                                        that does not batch)
    <prefix>.chunks.<router-id>         TokenChunkBatch (a decode worker's step, all of this
                                        router's requests on that worker in one message)

Both are subscribed once, at the first request, instead of a SUB and an UNSUB per request
(each a protocol line to the server and a subscription task in nats-py, whose wake-up per
chunk was a good part of the per-token cost at 64 streams). Chunks are decoded here, in the
subscription's callback, and put on the request's queue; a chunk for a request that is no
longer open (it ended, or a late chunk after a cancel) is dropped.
"""

from __future__ import annotations

import asyncio
import itertools

from nats.aio.msg import Msg

from libs.common.bus import Bus
from libs.common.log import get_logger
from libs.common.messages import MessageError, TokenChunk, TokenChunkBatch

log = get_logger(__name__)


class StreamTable:
    """`open(rid)` -> (subject, queue of TokenChunk); `close(rid)` when the request ends."""

    def __init__(self, bus: Bus, prefix: str, router_id: str):
        self.bus = bus
        self.stream_prefix = f"{prefix}.stream.{router_id}."
        self.batch_subject = f"{prefix}.chunks.{router_id}"
        self._queues: dict[str, asyncio.Queue[TokenChunk]] = {}
        self._subs: list = []
        self._starting: asyncio.Lock = asyncio.Lock()
        self._dupes = itertools.count(1)

    async def start(self) -> None:
        """Subscribe (once; later calls return at once). Flushed: the server has the
        interest before the first GenerateRequest goes out, so no chunk is missed."""
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
            await nc.flush()
            self._subs = subs

    def open(self, rid: str) -> tuple[str, str, asyncio.Queue[TokenChunk]]:
        """A queue for `rid`; returns (wire id, stream subject, queue). The wire id is `rid`
        unless a request with that id is already open here (a client may reuse its
        x-request-id): then `rid-d<n>`, so the two never read each other's tokens."""
        wire = rid
        while wire in self._queues:
            wire = f"{rid}-d{next(self._dupes)}"
        queue: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self._queues[wire] = queue
        return wire, self.stream_prefix + wire, queue

    def close(self, wire: str) -> None:
        self._queues.pop(wire, None)

    def __len__(self) -> int:
        return len(self._queues)

    async def stop(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            try:
                await sub.unsubscribe()
            except Exception as e:  # the connection may already be closed
                log.debug("stream subscription not removed", error=str(e))

    async def _on_chunk(self, msg: Msg) -> None:
        queue = self._queues.get(msg.subject[len(self.stream_prefix) :])
        if queue is None:
            return  # the request ended: a late chunk
        try:
            queue.put_nowait(TokenChunk.decode(msg.data))
        except MessageError as e:
            log.warning("unreadable token chunk dropped", error=str(e))

    async def _on_batch(self, msg: Msg) -> None:
        try:
            batch = TokenChunkBatch.decode(msg.data)
        except MessageError as e:
            log.warning("unreadable token chunk batch dropped", error=str(e))
            return
        queues = self._queues
        for chunk in batch.chunks:
            queue = queues.get(chunk.request_id)
            if queue is not None:
                queue.put_nowait(chunk)
