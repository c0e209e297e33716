"""Connections to the HTTP API: how long a client may take, and how many it may hold.

aiohttp closes an idle keep-alive connection (--keepalive-timeout) and reads bodies, but
it has no deadline for a request's headers or body and no cap on connections: a client
dripping header bytes, or declaring a large body and stalling, holds a socket forever.
This module and connection_middleware.py add what it lacks, around aiohttp's own
protocol, through public API only:

    Listener   the listening socket; each accepted connection gets a `Connection` that
               counts it (--max-connections in all, --max-connections-per-address per
               client address; beyond either it answers 503 / 429 and closes) and wraps
               aiohttp's RequestHandler
    Connection from the first byte of a request (or the connection's open) to the end of
               its header block: --header-timeout (408, or a plain close when nothing was
               sent) and --max-header-bytes / --max-headers (431); it sees bytes only,
               the parsing stays aiohttp's. While an answer waits for a client that has
               stopped reading (the transport paused our writing): --send-timeout, then
               the connection is aborted
    connection_middleware.py  tells the Connection where each request begins and ends,
               and reads the body within --body-timeout (408, and the connection closed)

Every answer has OpenAI's error shape; the cost per byte is a length and a search for the
blank line, whatever the client sends.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast

import orjson

from libs.common.log import get_logger
from services.router.errors import ApiError

log = get_logger(__name__)

# A refused connection is answered, half-closed, and read (discarding) this long, so that
# the client reads the answer instead of a reset from the request bytes it already sent.
_REFUSAL_LINGER_S = 1.0
# aiohttp's own limits stay a little above ours: ours answer first, with a 431.
_AIOHTTP_SLACK_HEADERS = 8
_END = b"\r\n\r\n"


@dataclass(frozen=True)
class ConnectionLimits:
    """The flags of docs/security.md, "Connections" (RouterConfig holds their defaults and
    checks them)."""

    keepalive_timeout: float
    header_timeout: float
    body_timeout: float
    send_timeout: float
    max_header_bytes: int
    max_headers: int
    max_connections: int
    max_connections_per_address: int

    @classmethod
    def of(cls, config: Any) -> ConnectionLimits:
        """The limits set by a config holding fields of the same names (RouterConfig)."""
        names = cls.__dataclass_fields__
        return cls(**{name: getattr(config, name) for name in names})

    def runner_options(self) -> dict[str, Any]:
        """aiohttp's own limits (web.AppRunner's keyword arguments)."""
        return {
            "keepalive_timeout": self.keepalive_timeout,
            "max_line_size": self.max_header_bytes,
            "max_field_size": self.max_header_bytes,
            "max_headers": self.max_headers + _AIOHTTP_SLACK_HEADERS,
        }


def error_bytes(error: ApiError, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, with `error`'s body: written
    on the socket when no aiohttp request exists to answer through."""
    body = orjson.dumps(error.body())
    lines = [
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Listener:
    """The router's listening socket: each connection admitted under the caps goes to
    aiohttp's `server` (web.AppRunner.server) inside a `Connection`."""

    def __init__(
        self,
        server: Callable[[], asyncio.Protocol],
        limits: ConnectionLimits,
        on_refused: Callable[[str], None] = lambda limit: None,
    ):
        self.limits = limits
        self.on_refused = on_refused  # called with the flag (no dashes) of each refusal
        self._server = server
        self._listening: asyncio.AbstractServer | None = None
        self.open = 0
        self.by_address: Counter[str] = Counter()

    async def start(self, host: str, port: int) -> int:
        """Listen; return the bound port (port 0 picks a free one)."""
        loop = asyncio.get_running_loop()
        # The accept queue holds a burst of --max-connections (the kernel caps it at
        # net.core.somaxconn): at asyncio's 100, a burst of 1,000 overflowed it, and the
        # dropped handshakes left idle clients with sockets the router never saw.
        backlog = self.limits.max_connections
        self._listening = await loop.create_server(
            lambda: Connection(self), host, port, backlog=backlog
        )
        return int(self._listening.sockets[0].getsockname()[1])

    def close(self) -> None:
        """Stop accepting (open connections stay: the runner's cleanup drains them). Safe
        twice and before start."""
        listening, self._listening = self._listening, None
        if listening is not None:
            listening.close()

    def admit(self, address: str) -> ApiError | None:
        """Count a new connection from `address`, or the refusal it gets."""
        if self.open >= self.limits.max_connections:
            self.on_refused("max_connections")
            return ApiError(
                503,
                f"the router holds --max-connections ({self.limits.max_connections}) "
                "connections; retry later",
                code="too_many_connections",
            )
        if self.by_address[address] >= self.limits.max_connections_per_address:
            self.on_refused("max_connections_per_address")
            return ApiError(
                429,
                f"this address holds --max-connections-per-address "
                f"({self.limits.max_connections_per_address}) connections; reuse one",
                code="too_many_connections",
            )
        self.open += 1
        self.by_address[address] += 1
        return None

    def release(self, address: str) -> None:
        self.open -= 1
        self.by_address[address] -= 1
        if self.by_address[address] <= 0:
            del self.by_address[address]

    def handler(self) -> asyncio.Protocol:
        return self._server()


class Connection(asyncio.Protocol):
    """One client connection: aiohttp's protocol (`inner`) inside, with the header deadline
    and size limits in front of it. States: "headers" (counting bytes up to the blank
    line; the deadline runs), "started" (the blank line seen; the deadline runs until the
    request reaches `track`), "request" (a request is handled: no deadline here),
    "idle" (between requests: aiohttp's keep-alive timeout runs), "refused"."""

    def __init__(self, listener: Listener):
        self.listener = listener
        self.limits = listener.limits
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.address = ""
        self.admitted = False  # counted by the listener
        self.state = "headers"
        self._timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None  # while writing is paused
        self._seen = 0  # bytes of the current header block so far
        self._lines = 0  # line ends in it
        self._tail = b""  # its last 3 bytes: the blank line may straddle two reads
        self._requests = 0  # requests begun (a late end-of-body callback names its own)

    # asyncio.Protocol: the transport's calls, passed on to aiohttp's protocol.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass, but is one).
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        refusal = self.listener.admit(self.address)
        if refusal is not None:
            self._refuse(refusal, {"Retry-After": "1"})
            return
        self.admitted = True
        self.inner = self.listener.handler()
        self._arm()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is None or self.state == "refused":  # read and dropped
            return
        if self.state == "idle":
            self.state, self._seen, self._lines, self._tail = "headers", 0, 0, b""
            self._arm()
        if self.state == "headers" and not self._count(data):
            return
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.inner is None or self.state == "refused":
            return False  # the client has read the refusal: close
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._send_disarm()
        if self.admitted:
            self.listener.release(self.address)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        # The client reads slower than we write: it must read again within --send-timeout.
        self._send_disarm()
        loop = asyncio.get_running_loop()
        self._send_timer = loop.call_later(self.limits.send_timeout, self._send_stalled)
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        self._send_disarm()
        if self.inner is not None:
            self.inner.resume_writing()

    def _send_stalled(self) -> None:
        """The client has read nothing for --send-timeout while an answer waits: abort (a
        close would wait for the unread bytes); aiohttp cancels the request."""
        self._send_timer = None
        if self.transport is not None:
            log.info("connection aborted: the client stopped reading", address=self.address)
            self.listener.on_refused("send_timeout")
            self.transport.abort()

    def _send_disarm(self) -> None:
        timer, self._send_timer = self._send_timer, None
        if timer is not None:
            timer.cancel()

    # The request's boundaries, from the middlewares.

    def request_started(self) -> int:
        self._disarm()
        self.state = "request"
        self._requests += 1
        return self._requests

    def request_done(self, number: int) -> None:
        if self.state == "request" and number == self._requests:
            self.state = "idle"

    # The header block.

    def _count(self, data: bytes) -> bool:
        """Count `data` into the header block; False when it broke a limit (answered)."""
        end = (self._tail + data).find(_END)
        part = data if end < 0 else data[: max(0, end + len(_END) - len(self._tail))]
        self._seen += len(part)
        self._lines += part.count(b"\n")
        # The request line and each header end with a line end; so does the blank line.
        headers = self._lines - (2 if end >= 0 else 1)
        if self._seen > self.limits.max_header_bytes:
            self.listener.on_refused("max_header_bytes")
            self._refuse(_too_large(f"--max-header-bytes ({self.limits.max_header_bytes})"))
            return False
        if headers > self.limits.max_headers:
            self.listener.on_refused("max_headers")
            self._refuse(_too_large(f"--max-headers ({self.limits.max_headers}) header lines"))
            return False
        if end >= 0:
            self.state = "started"
            self._arm()  # the request must now reach `track`, as promptly
        else:
            self._tail = (self._tail + data)[-3:]
        return True

    # The deadline.

    def _arm(self) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.limits.header_timeout, self._timed_out)

    def _disarm(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _timed_out(self) -> None:
        self._timer = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.listener.on_refused("header_timeout")
        if self.state == "headers" and self._seen:
            limit = f"--header-timeout ({self.limits.header_timeout:g} s)"
            message = f"the request's headers did not arrive within {limit}"
            self._refuse(ApiError(408, message, code="request_timeout"))
        else:  # nothing sent yet, or aiohttp may be about to answer: just close
            log.debug("connection timed out", address=self.address, state=self.state)
            transport.close()

    # Refused: answered, half-closed, read and dropped until the client closes or for
    # _REFUSAL_LINGER_S (a client still sending then reads the answer, not a reset).

    def _refuse(self, error: ApiError, headers: dict[str, str] | None = None) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        log.debug("connection refused", address=self.address, status=error.status,
                  error=error.message)  # fmt: skip
        self.state = "refused"
        self._disarm()
        transport.write(error_bytes(error, headers))
        if transport.can_write_eof():
            transport.write_eof()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(_REFUSAL_LINGER_S, transport.close)


def _too_large(limit: str) -> ApiError:
    message = f"the request's headers are over {limit}"
    return ApiError(431, message, code="request_header_fields_too_large")
