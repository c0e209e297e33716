"""Server-Sent Events: the framing, and `SseStream`, which writes a response's events
straight from the bus's callback.

Framing is OpenAI's: each event is `data: <one JSON object>\\n\\n`; the stream ends with
`data: [DONE]\\n\\n`; an error after the stream started is one more event whose object
is `{"error": {...}}`, then `[DONE]`. JSON never holds a raw newline (orjson escapes
them), so one `data:` line per event is always enough.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import HttpVersion11, web

DONE = b"data: [DONE]\n\n"
MAX_BUFFERED = 4 << 20  # bytes a client may leave unread before it counts as gone


def sse(obj: Any) -> bytes:
    """One SSE event carrying `obj` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def parse_sse(raw: bytes) -> list[Any]:
    """Inverse of the framing (for tests and the benchmark): objects, then "[DONE]"."""
    out: list[Any] = []
    for event in raw.split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data: "):
                data = line[len(b"data: ") :]
                out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


class ClientGone(ConnectionResetError):
    """The client closed its connection, or left more than MAX_BUFFERED bytes unread."""


class SseStream:
    """One streamed response, fed by `send(bytes)` from a synchronous callback.

        send() ... send()              finish(tail)
        |  opening: status line, headers and the events so far go out through aiohttp
        |  (in a task: its first write awaits); later events wait in `pending`
        |  open: each send() is one write to the socket's transport, framed as an
        |  HTTP/1.1 chunk (raw for an HTTP/1.0 client, whose body ends with the
        |  connection): no await, no task switch per event
        finish(): the tail events, the last chunk and the end of the body, through aiohttp

    Until the first send() the HTTP status is still free: a request that fails before
    any output gets a plain error response, not an event inside a 200 stream. The router
    never compresses a stream, so writing past aiohttp's writer keeps the body exact.
    """

    def __init__(self, request: web.Request, headers: dict[str, str]):
        self.request, self.headers = request, headers
        self.response: web.StreamResponse | None = None
        self.opening: asyncio.Task[None] | None = None
        self.pending: list[bytes] = []
        self.failed: BaseException | None = None
        self._transport: asyncio.Transport | None = None
        self._chunked = False

    @property
    def started(self) -> bool:
        return self.opening is not None

    def send(self, data: bytes) -> None:
        """Write `data` now (or queue it while the response opens). Raises ClientGone."""
        if self._transport is not None:
            self._write(self._transport, data)
        elif self.failed is not None:
            raise ClientGone(f"the response could not start: {self.failed}")
        else:
            self.pending.append(data)
            self._opening()

    async def finish(self, tail: bytes) -> web.StreamResponse:
        """End the body with `tail`; returns the response for aiohttp."""
        if self.opening is None:
            self.send(b"")
        await self._opening()
        response = self.response
        if response is None:  # _open() failed, and said why in `failed`
            raise self.failed or ClientGone("the response could not start")
        await response.write_eof(tail)
        return response

    def _opening(self) -> asyncio.Task[None]:
        """The task that opens the response, started by the first call."""
        if self.opening is None:
            self.opening = asyncio.ensure_future(self._open())
        return self.opening

    async def _open(self) -> None:
        response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # proxies (nginx) must not hold events back
                **self.headers,
            },
        )
        if self.request.version >= HttpVersion11:
            response.enable_chunked_encoding()  # what aiohttp would choose; now known here
        try:
            await response.prepare(self.request)
            while self.pending:  # aiohttp sends its held-back headers with the first write
                data = b"".join(self.pending)
                self.pending.clear()
                await response.write(data)
        except Exception as e:  # a client gone while the headers went out; send() says so
            self.failed = e
            return
        transport = self.request.transport
        if transport is None:
            self.failed = ClientGone("the client closed the connection")
            return
        self.response, self._chunked, self._transport = response, response.chunked, transport

    def _write(self, transport: asyncio.Transport, data: bytes) -> None:
        if transport.is_closing():
            raise ClientGone("the client closed the connection")
        if transport.get_write_buffer_size() > MAX_BUFFERED:
            raise ClientGone(f"the client left over {MAX_BUFFERED} bytes unread")
        if data:
            transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
