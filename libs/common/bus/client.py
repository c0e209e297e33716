"""A nats-py client with fewer task hops on the request/reply path.

Stock nats-py (2.16) moves every message through two extra asyncio tasks per side: a
publish wakes the flusher task, which writes the socket on a later loop turn; a received
message goes into its subscription's queue, from which that subscription's task calls
the callback on a later turn. A pool `exists` (client -> nats-server -> master and back)
pays four such hops; measured here they were ~60-80 us of a ~300 us round trip
(docs/benchmarks.md, "KV pool"). `FastClient` keeps nats-py for everything else
(connect, reconnect, resubscribe, JetStream, micro) and changes two things:

  - A publish writes the socket at once when the connection is up and the socket keeps
    up (the transport's write buffer is empty); otherwise (reconnecting, back-pressure)
    it goes through nats-py's flusher as before, which waits for the socket to drain.
  - Subscriptions registered with `dispatch_inline(sid, fn)` get `fn(msg)` called from
    the connection's read loop, without the queue and task. Only for callbacks that
    never wait on the bus (a callback that awaits a reply here would wait for the read
    loop it is blocking); everything else keeps nats-py's path. What `fn` publishes
    (a master's index updates and events, then its reply) goes out in one socket write
    when it returns: on loopback each write costs ~20-30 us of TCP in the sender
    (measured: a master's put_end made three).

`Replies` is the request side: one wildcard inbox subscription, dispatched inline, that
completes the caller's future directly.

Both rely on nats-py internals (`_process_msg`, `_flush_pending`, `_pending`), pinned in
requirements/base.txt; tests/bus/test_bus_client.py fails if they change.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

NO_RESPONDERS = "503"


class FastClient(Client):
    """nats-py's Client with direct socket writes and inline dispatch (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._inline: dict[int, Callable[[Msg], Awaitable[None]]] = {}
        self._holding = 0  # > 0 while an inline callback runs: its publishes wait for it

    def dispatch_inline(self, sid: int, fn: Callable[[Msg], Awaitable[None]]) -> None:
        self._inline[sid] = fn

    def drop_inline(self, sid: int) -> None:
        self._inline.pop(sid, None)

    def _write_now(self) -> bool:
        """Write what is pending to the socket now; False when nats-py's flusher must."""
        if not self.is_connected or self._flusher_task is None or self._flusher_task.done():
            return False
        writer = getattr(self._transport, "_io_writer", None)
        if writer is None or writer.transport.get_write_buffer_size():
            return False  # not plain TCP, or the socket is behind: the flusher drains it
        self._transport.writelines(self._pending)
        self._pending = []
        self._pending_data_size = 0
        return True

    async def _flush_pending(self, force_flush: bool = False) -> Any:
        if not force_flush and self._pending_data_size and (self._holding or self._write_now()):
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        return await super()._flush_pending(force_flush)

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        fn = self._inline.get(sid)
        if fn is None or sid not in self._subs:
            return await super()._process_msg(sid, subject, reply, data, headers)
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        hdr = await self._process_headers(headers) if headers else None
        msg = self._build_message(sid, subject, reply, data, hdr)
        self._holding += 1
        try:
            await fn(msg)
        except Exception as e:  # as nats-py does for a callback: reported, not fatal
            await self._error_cb(e)
        finally:
            self._holding -= 1
        if not self._holding and self._pending_data_size and not self._write_now():
            await super()._flush_pending()  # reconnecting or behind: nats-py's flusher


class Replies:
    """Request/reply over one inbox subscription whose replies complete futures inline."""

    def __init__(self, nc: FastClient):
        self.nc = nc
        self._prefix = ""
        self._waiting: dict[str, asyncio.Future[Msg]] = {}
        self._next = 0
        self._lock = asyncio.Lock()

    async def _ensure(self) -> str:
        if not self._prefix:
            async with self._lock:
                if not self._prefix:
                    prefix = self.nc.new_inbox() + "."
                    sub = await self.nc.subscribe(prefix + "*")
                    # No flush: the server takes the SUB before the request that follows it
                    # on this connection (and a flush would wait out a reconnect).
                    self.nc.dispatch_inline(sub._id, self._on_reply)
                    self._prefix = prefix
        return self._prefix

    async def _on_reply(self, msg: Msg) -> None:
        future = self._waiting.pop(msg.subject, None)
        if future is not None and not future.done():
            future.set_result(msg)

    async def request(self, subject: str, payload: bytes, timeout: float) -> Msg:
        """Like nats-py's request: raises nats' TimeoutError / NoRespondersError."""
        prefix = await self._ensure()
        self._next += 1
        inbox = f"{prefix}{self._next}"
        future = asyncio.get_running_loop().create_future()
        self._waiting[inbox] = future
        try:
            await self.nc.publish(subject, payload, reply=inbox)
            async with asyncio.timeout(timeout):
                msg = await future
        except TimeoutError:
            raise NatsTimeoutError from None
        finally:
            self._waiting.pop(inbox, None)
        if not msg.data and msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            raise NoRespondersError
        return msg
