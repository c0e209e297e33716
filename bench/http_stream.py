"""A lean HTTP/1.1 streaming client for bench.router: POST, then each SSE event with the
time its bytes reached this process.

The router's added latency is what happens between the bus and the client's socket. A
full client (aiohttp: a task, a StreamReader and a line parser per stream) reading 64
streams in one event loop stamps an event only when that stream's task gets its turn,
after the others' reads: its own queueing lands in the router's figure. This client
stamps in `data_received`, the loop's first Python call for the bytes, keeps them, and
parses them after the response ended. It also sends each request as one ready-made
write on a kept-alive connection, so the request's `front` is not the client building
64 requests in Python either.

Only what the router sends is handled: status 200 with a chunked body (anything else
raises), `data: ` events, keep-alive.
"""

from __future__ import annotations

import asyncio
import time

import orjson


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.raw = bytearray()
        self.marks: list[tuple[int, float]] = []  # (bytes received so far, monotonic time)
        self.done: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        self.raw += data
        self.marks.append((len(self.raw), now))
        done = self.done
        if done is None or done.done():
            return
        if len(self.marks) == 1 and not self.raw.startswith(b"HTTP/1.1 200"):
            done.set_exception(RuntimeError(f"not a 200 stream: {bytes(self.raw[:200])!r}"))
        elif self.raw.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of a chunked body
            done.set_result(None)

    def connection_lost(self, exc) -> None:
        self.transport = None
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"connection lost: {exc}"))


class LeanClient:
    """POSTs to one host:port over kept-alive connections (one per request in flight)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.idle: list[_Connection] = []

    async def stream(self, path: str, body: dict, headers: dict[str, str]):
        """-> (start, [(event bytes after `data: `, arrival time of its chunk's last byte)])."""
        loop = asyncio.get_running_loop()
        conn = self.idle.pop() if self.idle else None
        if conn is None or conn.transport is None:
            _, conn = await loop.create_connection(_Connection, self.host, self.port)
        payload = orjson.dumps(body)
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                   f"{head}\r\n").encode() + payload  # fmt: skip
        conn.raw.clear()
        conn.marks.clear()
        conn.done = loop.create_future()
        start = time.monotonic()
        conn.transport.write(request)
        await conn.done
        events = _events(bytes(conn.raw), conn.marks)
        self.idle.append(conn)
        return start, events

    def close(self) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()


def _events(raw: bytes, marks: list[tuple[int, float]]) -> list[tuple[bytes, float]]:
    end = raw.index(b"\r\n\r\n") + 4
    if b"transfer-encoding: chunked" not in raw[:end].lower():
        raise RuntimeError("the stream is not chunked")
    out: list[tuple[bytes, float]] = []
    pos, m = end, 0
    while True:
        line_end = raw.index(b"\r\n", pos)
        size = int(raw[pos:line_end], 16)
        if size == 0:
            return out
        start, stop = line_end + 2, line_end + 2 + size
        while marks[m][0] < stop:  # the first read that held this chunk's last byte
            m += 1
        for event in raw[start:stop].split(b"\n\n"):
            if event.startswith(b"data: "):
                out.append((event[6:], marks[m][1]))
        pos = stop + 2
