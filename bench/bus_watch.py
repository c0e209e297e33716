"""bench.router's bus watcher, in a process of its own: when each GenerateRequest and each
token chunk appeared on the bus.

    python -m bench.bus_watch --nats-url URL --worker bench-d1 --router bench-router

Timestamps are `time.monotonic()`, CLOCK_MONOTONIC on Linux: one clock for every process
of the host, so the benchmark's client compares them with its own. They are taken first
thing in each message's callback, before any decoding, by a process that does nothing
else: a client that reads 64 HTTP streams in one event loop cannot say when a chunk
reached the bus (the callback that stamps it waits behind the HTTP reads, or the reads
behind it, and the measured hold swung severalfold between identical runs).

Watched: `<prefix>.decode.<worker>.generate` (GenerateRequest; by request id),
`<prefix>.stream.>` (TokenChunk one by one: the router's `stream.<router>.<rid>` and the
direct client's `stream.<rid>`) and `<prefix>.chunks.<router>` (TokenChunkBatch).
`<prefix>.bench.watch.take` (any body) replies with what was seen since the last take,
`{"generate": {rid: t}, "chunks": {rid: [t of each chunk with tokens]}}`, and forgets it;
it is subscribed last, so a reply means every other subscription is on the server.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from collections import defaultdict

import orjson

from libs.common import event_loop
from libs.common.bus.connection import Bus
from libs.common.messages.control import TokenChunk, TokenChunkBatch


class Seen:
    """What the watcher saw since the last take."""

    def __init__(self) -> None:
        self.generate: dict[str, float] = {}
        self.chunks: defaultdict[str, list[float]] = defaultdict(list)
        # The router's request id on the bus -> the client's X-Request-Id, which the
        # GenerateRequest carries as its label: the bench knows its requests by the latter.
        self.labels: dict[str, str] = {}

    async def on_generate(self, msg) -> None:
        now = time.monotonic()
        request = orjson.loads(msg.data)
        label = request.get("label") or request["request_id"]
        self.labels[request["request_id"]] = label
        self.generate[label] = now

    def _chunk(self, chunk: TokenChunk, now: float) -> None:
        if chunk.token_ids:
            self.chunks[self.labels.get(chunk.request_id, chunk.request_id)].append(now)

    async def on_chunk(self, msg) -> None:
        self._chunk(TokenChunk.decode(msg.data), time.monotonic())

    async def on_batch(self, msg) -> None:
        now = time.monotonic()
        for chunk in TokenChunkBatch.decode(msg.data).chunks:
            self._chunk(chunk, now)

    async def on_take(self, msg) -> None:
        body = orjson.dumps({"generate": self.generate, "chunks": self.chunks})
        self.generate, self.chunks = {}, defaultdict(list)
        await msg.respond(body)


async def watch(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    bus = Bus(args.nats_url, "bench-bus-watch", connect_timeout=10, request_timeout=10)
    await bus.connect()
    seen, nc, p = Seen(), bus.nc, args.prefix
    try:
        await nc.subscribe(f"{p}.decode.{args.worker}.generate", cb=seen.on_generate)
        await nc.subscribe(f"{p}.stream.>", cb=seen.on_chunk)
        await nc.subscribe(f"{p}.chunks.{args.router}", cb=seen.on_batch)
        await nc.subscribe(f"{p}.bench.watch.take", cb=seen.on_take)
        await nc.flush()
        await stop.wait()
    finally:
        await bus.close()


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.bus_watch", description=__doc__.split("\n")[0]
    )
    p.add_argument("--nats-url", required=True)
    p.add_argument("--prefix", default="tandem")
    p.add_argument("--worker", required=True, help="the decode worker's service id")
    p.add_argument("--router", required=True, help="the router's service id")
    event_loop.run(watch(p.parse_args()))


if __name__ == "__main__":
    main()
