"""The request side of the connection limits (connections.py has the socket side).

    track      (outermost middleware) tells the request's `Connection` that it began,
               which stops the header deadline, and that it ended, which lets the next
               request's deadline start
    read_body  (innermost middleware, after the API key check) reads the body within
               --body-timeout: past it 408, and the connection is closed

app.py lists them around its own middleware: `track` first, `read_body` last.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from services.router.api.connections import Connection, ConnectionLimits
from services.router.errors import ApiError

# A request's mark: force-close its connection after the answer.
_CLOSE: web.RequestKey[bool] = web.RequestKey("close_connection", bool)


LIMITS: web.AppKey[ConnectionLimits] = web.AppKey("connection_limits", ConnectionLimits)


def install(app: web.Application, limits: ConnectionLimits) -> None:
    """Give `app` the limits its middlewares read."""
    app[LIMITS] = limits


def _connection(request: web.Request) -> Connection | None:
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    return protocol if isinstance(protocol, Connection) else None


@web.middleware
async def track(request: web.Request, handler: Any) -> web.StreamResponse:
    """Outermost: the connection's header deadline stops here, and its next request's
    starts once this one's body has been read to its end. A request whose body timed out
    is answered and its connection closed here: aiohttp would otherwise wait (its
    lingering time) for the rest of a body that is not coming."""
    connection = _connection(request)
    if connection is None:
        return await handler(request)
    number = connection.request_started()
    try:
        response = await handler(request)
        if request.get(_CLOSE) and request.transport is not None:
            response.force_close()
            await response.prepare(request)
            await response.write_eof()
            request.transport.close()  # after what was written
        return response
    finally:
        if request.content.is_eof():
            connection.request_done(number)
        else:  # aiohttp reads the rest after the answer (or closes)
            request.content.on_eof(lambda: connection.request_done(number))


@web.middleware
async def read_body(request: web.Request, handler: Any) -> web.StreamResponse:
    """Innermost: the body arrives whole within --body-timeout, or the answer is 408 and
    the connection is closed. The handlers' own reads then return what was read (aiohttp
    keeps a request's body once read)."""
    if request.can_read_body:
        timeout = request.app[LIMITS].body_timeout
        try:
            await asyncio.wait_for(request.read(), timeout)
        except TimeoutError:
            request[_CLOSE] = True
            connection = _connection(request)
            if connection is not None:
                connection.listener.on_refused("body_timeout")
            raise ApiError(
                408,
                f"the request body did not arrive within --body-timeout ({timeout:g} s)",
                code="request_timeout",
            ) from None
    return await handler(request)
