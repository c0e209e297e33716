"""The NATS bus: a thin layer over nats-py that every service uses.

- `connect()` retries the first connection for `connect_timeout` seconds and then fails with
  an error naming the URL; once connected, reconnects never give up (a NATS restart must not
  need a restart of any service).
- `request()` always has a timeout, encodes and decodes typed messages, and turns an error
  reply (the `Nats-Service-Error` headers of the micro protocol) into `RemoteError`.
  It is nats-py's `Client.request`: replies come back on one wildcard inbox subscription
  whose callback completes the caller's future.
- `add_service()` registers a `nats.micro` service (`nats micro ls` shows it) whose
  endpoints take a typed request and return a typed reply; an exception in a handler
  becomes an error reply and never kills the subscription that serves everyone else.
- Traces cross the bus: `request()` sends the current trace context as a `traceparent`
  header, and an endpoint whose request carries one runs its handler inside a server span
  of that trace (libs/common/tracing.py; nothing is added while tracing is off).
- Subscriptions (micro endpoints included) come back by themselves after a reconnect;
  state a restarted nats-server lost (a JetStream stream, a consumer) does not:
  `on_reconnect(hook)` re-creates it after every reconnect.

Only nats-py's public API is used (`Client.connect/subscribe/publish/new_inbox/flush/
drain/close`, `nats.micro.add_service`, `Service.add_endpoint/stats/stop`, JetStream).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro import ServiceConfig, add_service
from nats.micro.request import Request
from nats.micro.service import EndpointConfig, Service

from libs.common import tracing
from libs.common.bus.credentials import connect_options
from libs.common.config import redact_url
from libs.common.log import get_logger
from libs.common.messages.control import ErrorReply, Message, MessageError

log = get_logger(__name__)

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)

ERROR_HEADER = "Nats-Service-Error"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"


class BusError(Exception):
    """The bus could not do what was asked (no connection, no responder, timeout)."""


class RemoteError(BusError):
    """The remote service answered with an error reply."""

    def __init__(self, subject: str, code: int, message: str):
        super().__init__(f"{subject}: error {code}: {message}")
        self.subject, self.code, self.message = subject, code, message


class HandlerError(Exception):
    """Raise in an endpoint handler to answer with this code (4xx: the caller's fault)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Endpoint:
    """One micro endpoint: `handler(request message) -> reply message`.

    `concurrent=True` runs each request in its own task, for handlers that wait on long
    work; nats-py otherwise calls a subscription's handler one message at a time (each
    endpoint is one subscription, served by its own task).
    """

    name: str
    subject: str
    request_type: type[Message]
    handler: Callable[[Any], Awaitable[Message]]
    queue_group: str | None = None
    concurrent: bool = False


class Bus:
    """A NATS connection with typed request/reply, publish, subscribe and micro services."""

    def __init__(
        self,
        url: str,
        name: str,
        connect_timeout: float,
        request_timeout: float,
        credentials_file: str = "",
    ):
        """`credentials_file`: this identity's `user:password` (libs/common/bus/credentials.py)."""
        self.url, self.name = url, name
        self.credentials_file = credentials_file
        self.connect_timeout, self.request_timeout = connect_timeout, request_timeout
        self._nc: Client | None = None
        self._services: list[Service] = []
        self._tasks: set[asyncio.Task] = set()
        self._reconnect_hooks: list[Callable[[], Awaitable[None]]] = []
        self._hook_tasks: set[asyncio.Task] = set()

    @property
    def nc(self) -> Client:
        if self._nc is None:
            raise BusError("bus is not connected")
        return self._nc

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def connect(self) -> None:
        try:
            identity = connect_options(self.url, self.credentials_file)
        except ValueError as e:
            raise BusError(str(e)) from None
        nc = Client()
        try:
            await asyncio.wait_for(
                nc.connect(
                    servers=[u.strip() for u in self.url.split(",")],
                    name=self.name,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    # nats-py annotates an int; it only adds and sleeps it (seconds).
                    reconnect_time_wait=0.5,  # type: ignore[arg-type]
                    connect_timeout=2,
                    error_cb=self._on_error,
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                    **identity,
                ),
                timeout=self.connect_timeout,
            )
        except (TimeoutError, OSError, nats.errors.Error) as e:
            await nc.close()
            raise BusError(
                f"cannot connect to NATS at {redact_url(self.url)} "
                f"within {self.connect_timeout:g}s "
                f"(is nats-server running there? set --nats-url): {e or type(e).__name__}"
            ) from None
        self._nc = nc
        log.info("nats connected", url=redact_url(self.url), user=identity.get("user", ""))

    async def _on_error(self, e: Exception) -> None:
        log.warning("nats error", error=str(e) or type(e).__name__)

    async def _on_disconnected(self) -> None:
        if self._nc is not None:  # not a close() of ours
            log.warning("nats disconnected; reconnecting")

    async def _on_reconnected(self) -> None:
        log.info("nats reconnected")
        for hook in self._reconnect_hooks:  # in tasks: the client's callback must not block
            task = asyncio.ensure_future(self._run_hook(hook))
            self._hook_tasks.add(task)
            task.add_done_callback(self._hook_tasks.discard)

    def on_reconnect(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Call `hook()` after every reconnect (not the first connect). A hook that raises
        is logged; it should retry what it needs itself."""
        self._reconnect_hooks.append(hook)

    async def _run_hook(self, hook: Callable[[], Awaitable[None]]) -> None:
        try:
            await hook()
        except Exception:
            log.exception("reconnect hook failed", hook=getattr(hook, "__qualname__", str(hook)))

    async def publish(self, subject: str, message: Message) -> None:
        await self.nc.publish(subject, message.encode())

    async def request(
        self,
        subject: str,
        message: Message,
        reply_type: type[R],
        timeout: float | None = None,
        responder_wait: float | None = None,
    ) -> R:
        """Send `message`, wait for one reply of `reply_type`; raise RemoteError/BusError.

        "No responders" is retried for `responder_wait` seconds (default: the whole
        timeout); a caller with a fallback (the pool: compute instead) gives up sooner."""
        timeout = self.request_timeout if timeout is None else timeout
        now = asyncio.get_running_loop().time()
        deadline = now + timeout
        give_up = now + (timeout if responder_wait is None else min(responder_wait, timeout))
        payload, pause, headers = message.encode(), 0.02, tracing.headers()
        while True:
            left = deadline - asyncio.get_running_loop().time()
            try:
                msg = await self.nc.request(
                    subject, payload, timeout=max(left, 0.001), headers=headers
                )
                break
            except nats.errors.NoRespondersError:
                # A responder may be (re)subscribing: a service restarting, a reconnect, or
                # a nats-server in its first moments (seen: a fresh server answers
                # "no responders" once to an interest it already has). Retry until the
                # deadline rather than fail a request that would succeed moments later.
                if give_up - asyncio.get_running_loop().time() <= pause:
                    raise BusError(f"{subject}: no service is listening") from None
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.25)
            except nats.errors.TimeoutError:
                raise BusError(f"{subject}: no reply within {timeout:g}s") from None
        headers = msg.headers or {}
        if ERROR_HEADER in headers:
            code = headers.get(ERROR_CODE_HEADER, "500")
            raise RemoteError(subject, int(code) if code.isdigit() else 500, headers[ERROR_HEADER])
        try:
            return reply_type.decode(msg.data)
        except MessageError as e:
            raise BusError(f"{subject}: bad reply: {e}") from None

    async def subscribe(
        self, subject: str, handler: Callable[[Msg], Awaitable[None]], queue: str = ""
    ) -> Any:
        """Subscribe; when this returns the server holds the subscription (`settle`), so a
        message any connection publishes from then on reaches `handler`."""
        sub = await self.nc.subscribe(subject, queue=queue, cb=handler)
        await settle(self.nc)
        return sub

    async def add_service(
        self,
        name: str,
        version: str,
        description: str,
        endpoints: list[Endpoint],
        metadata: dict[str, str] | None = None,
    ) -> Service:
        service = await add_service(
            self.nc,
            ServiceConfig(name=name, version=version, description=description, metadata=metadata),
        )
        for ep in endpoints:
            await service.add_endpoint(
                EndpointConfig(
                    name=ep.name,
                    subject=ep.subject,
                    queue_group=ep.queue_group,
                    handler=self._wrap(ep),
                    metadata={"request": ep.request_type.TYPE},
                )
            )
        await settle(self.nc)  # the endpoints are subscribed on the server when this returns
        self._services.append(service)
        return service

    def _wrap(self, ep: Endpoint) -> Callable[[Request], Awaitable[None]]:
        async def serve(req: Request) -> None:
            try:
                message = ep.request_type.decode(req.data or b"{}")
                reply = await _handle(ep, message, tracing.remote(req.headers))
            except MessageError as e:
                await _respond_error(req, 400, str(e))
            except HandlerError as e:
                await _respond_error(req, e.code, e.message)
            except asyncio.CancelledError:
                await _respond_error(req, 503, "service is shutting down")
                raise
            except Exception as e:
                log.exception("endpoint failed", endpoint=ep.name)
                await _respond_error(req, 500, f"{ep.name} failed: {type(e).__name__}: {e}")
            else:
                data = reply.encode()
                limit = self.nc.max_payload
                if len(data) > limit:  # nats-py would raise: answer the caller instead
                    log.warning("reply over the max payload", endpoint=ep.name, size=len(data))
                    await _respond_error(
                        req, 413, f"{ep.name}: the reply is {len(data)} bytes, over NATS's "
                        f"max payload of {limit}; ask for less per request",
                    )  # fmt: skip
                else:
                    await req.respond(data)

        if not ep.concurrent:
            return serve

        async def spawn(req: Request) -> None:
            self.spawn(serve(req))

        return spawn

    def spawn(self, coro: Awaitable[Any], name: str | None = None) -> asyncio.Task:
        """Run `coro` as tracked in-flight work: a stop waits for it (`wait_in_flight`)."""
        task = asyncio.ensure_future(coro)
        if name:
            task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def stop_services(self) -> None:
        """Stop answering: unsubscribe every micro endpoint (in-flight work continues)."""
        services, self._services = self._services, []
        for service in services:
            try:
                await asyncio.wait_for(service.stop(), timeout=5)
            except Exception as e:  # offline or half-started: must not block shutdown
                log.warning("micro service stop failed", error=str(e))

    async def wait_in_flight(self, timeout: float) -> int:
        """Wait up to `timeout` for concurrent handlers; cancel the rest; return that count."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        left = [t for t in self._tasks if not t.done()]
        for task in left:
            task.cancel()
        return len(left)

    async def close(self) -> None:
        """Flush and close. Safe to call twice and before connect()."""
        await self.stop_services()
        for task in list(self._hook_tasks):
            task.cancel()
        nc, self._nc = self._nc, None
        if nc is None or nc.is_closed:
            return
        try:
            if nc.is_connected:  # drain flushes what we published; impossible while offline
                await asyncio.wait_for(nc.drain(), timeout=5)
        except Exception as e:
            log.warning("nats drain failed; closing", error=str(e) or type(e).__name__)
        finally:
            try:
                await asyncio.wait_for(nc.close(), timeout=5)
            except Exception as e:
                log.warning("nats close failed", error=str(e) or type(e).__name__)


async def settle(nc: Client) -> None:
    """Return once the server has read every command this connection sent before the call
    (a SUB just made above all).

    One `flush()` does not promise that with nats-py (2.6-2.16): its PING is written to the
    socket at once, while a SUB waits in the client's queue for its flusher task. The
    server can read the PING first and answer it before it has the SUB; a message another
    connection publishes in between is not delivered to the new subscription (seen about
    once in 20 fresh subscriptions on a loaded host, and every time when the SUB is
    delayed on its way; tests/bus/test_settle.py). The first flush's wait lets the flusher
    write the queued commands; the second PING goes out behind them, so its PONG comes
    after the server has read them."""
    await nc.flush()
    await nc.flush()


async def _handle(ep: Endpoint, message: Message, context: Any) -> Message:
    """The handler's reply; inside a server span when the request came with a trace."""
    if context is None:
        return await ep.handler(message)
    rid = getattr(message, "request_id", "")
    with tracing.span(ep.name, rid, context=context, kind=tracing.SpanKind.SERVER):
        return await ep.handler(message)


async def _respond_error(req: Request, code: int, message: str) -> None:
    body = ErrorReply(code=code, message=message).encode()
    # The description travels in a header too, where a line break would end the header.
    await req.respond_error(str(code), " ".join(message.split()), data=body)


async def discover(nc: Client, name: str | None = None, timeout: float = 0.5) -> list[dict]:
    """Ping micro services (all, or those named `name`) and collect replies for `timeout`.

    The same as `nats micro ping [name]`: every live instance answers once.
    """
    subject = "$SRV.PING" + (f".{name}" if name else "")
    inbox = nc.new_inbox()
    replies: list[dict] = []

    async def collect(msg: Msg) -> None:
        if not msg.data:  # the server's "no responders" status: nobody registered yet
            return
        try:
            replies.append(orjson.loads(msg.data))
        except orjson.JSONDecodeError:
            log.warning("discover: unreadable ping reply", subject=msg.subject)

    sub = await nc.subscribe(inbox, cb=collect)
    try:
        await nc.publish(subject, b"", reply=inbox)
        await nc.flush()
        await asyncio.sleep(timeout)
    finally:
        await sub.unsubscribe()
    return replies
