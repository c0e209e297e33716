"""One generation on the workers: send GenerateRequest, hand its TokenChunks on in order.

    run(rid, ids, sampling, route, timeout, sink)              (a coroutine)
      open <rid> in the router's StreamTable (its two subscriptions exist before any
      request goes out, so no chunk is missed; services/router/dispatch/subscriptions.py)
      GenerateRequest -> tandem.decode.<d>.generate  -> GenerateAccepted (or an error)
      sink(chunk) for each TokenChunk in `index` order, called in the bus's callback
      (no queue, no task switch per chunk), until the chunk with finish_reason; then
      run returns
    generate(...)                                              (an async generator)
      the same chunks pulled one by one (run in a task, through a queue): for tests and
      callers that want to iterate

Failure handling, in one place:
- the decode worker has no room (429): wait with backoff and route again, up to
  --queue-timeout, then 429 to the client;
- the decode worker refuses (error reply, no responder, no reply in time), a worker on
  the route stops reporting, or the stream ends in an error, *before any chunk reached
  the sink*: retried once on a route that avoids the failed workers (`<rid>-r1`); if
  that fails too, 503 with Retry-After (nothing was produced: safe to retry);
- the same after chunks reached the sink: the request *migrates*: it continues on a live
  decode worker (`<rid>-r<n>`), one that has not failed it if there is one (a worker that
  failed but still reports, e.g. whose chunks NATS lost, may take it back), as a
  GenerateRequest whose `generated` holds every token the sink has had; that worker
  prefills prompt + those tokens itself, replays them through the grammar and stop
  strings and streams from index len(generated), so the sink sees one uninterrupted,
  duplicate-free stream (greedy: the same tokens). With no decode worker live, or after
  `MAX_MIGRATIONS` continuations: 502 `worker_failed`, as before migration
  (services/router/dispatch/migration.py; docs/reliability.md "Migration");
- chunks lost in transit while both workers are live (a restarted nats-server drops what
  it held, and what is published before the router has subscribed again): a hole in the
  chunk order for `lost_after` seconds, or a started stream silent for `lost_after` since
  the router's last reconnect, is a worker failure too, never an endless wait;
- the sink raises (the client went away): run stops and raises that exception;
- the caller is cancelled, the sink raised, or the time is up (504): `CancelRequest` on
  `tandem.cancel` so every worker frees the request's pages.
The waits are checked by one sweeper task for all streams (every 0.25 s while any
waits), not by a timer per stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable

from libs.common import tracing
from libs.common.bus.connection import Bus, BusError, RemoteError
from libs.common.log import get_logger
from libs.common.messages.control import (
    CancelRequest,
    GenerateAccepted,
    GenerateRequest,
    SamplingSpec,
    TokenChunk,
)
from services.router.dispatch.chunk_order import FAILED, ChunkOrder
from services.router.dispatch.migration import Generation, next_route
from services.router.dispatch.subscriptions import StreamTable
from services.router.errors import ApiError
from services.router.routing.policy import Route
from services.router.routing.workers import Worker, WorkerTable

log = get_logger(__name__)

_POLL_S = 0.25  # how often a waiting stream checks that its workers still report

Sink = Callable[[TokenChunk], None]


class WorkerBusy(Exception):
    """The decode worker has no room now (429): wait and route again, not a failure."""


class WorkerFailed(Exception):
    """A worker failed or vanished; `streamed` says whether chunks had reached the sink."""

    def __init__(self, message: str, streamed: bool):
        super().__init__(message)
        self.streamed = streamed


class _Stream:
    """One attempt's chunks, from the StreamTable's callback to the caller's sink.

    `done` resolves when the final chunk went to the sink, or fails with the reason the
    stream cannot go on (a worker's error chunk, or whatever the sink raised)."""

    def __init__(
        self, sink: Sink, route: Route, deadline: float, prefill: Worker | None, pending: int,
        start: int = 0,
    ):  # fmt: skip
        self.sink, self.order = sink, ChunkOrder(start)  # a continuation starts at `start`
        self.route, self.deadline = route, deadline
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.delivered = 0  # chunks handed to the sink
        self.prefill, self.pending = prefill, pending  # prompt tokens this route still owes
        self.decode_instance = ""  # the decode worker's process (LoadReport.instance)
        self.span: tracing.Span | None = None  # its `router.stream` span, when traced

    def on_chunk(self, chunk: TokenChunk) -> None:
        if self.done.done():
            return
        try:
            for c in self.order.push(chunk):
                self.settle()
                if c.finish_reason in FAILED:
                    reason = c.error or f"the worker ended the request ({c.finish_reason})"
                    raise WorkerFailed(reason, c.index > 0 or self.delivered > 0)
                self.sink(c)
                if not self.delivered and self.span is not None:  # TTFT, in the trace
                    self.span.add_event("first chunk written", {"tandem.index": c.index})
                self.delivered += 1
                if c.finish_reason is not None:
                    self.done.set_result(None)
        except Exception as e:  # the stream ends here; the waiting run() raises it
            self.done.set_exception(e)

    def fail(self, error: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(error)

    @property
    def ended(self) -> bool:
        """The final chunk reached the sink: nothing is left to cancel on the workers."""
        done = self.done
        return done.done() and not done.cancelled() and done.exception() is None

    def settle(self) -> None:
        """The prefill is over (or will never happen): its tokens leave the worker's load."""
        if self.prefill is not None and self.pending:
            self.prefill.pending_prefill_tokens -= self.pending
            self.pending = 0


class Dispatcher:
    """Runs generations over the bus; see the module docstring for the contract.

    `route(exclude)` picks a route avoiding the worker ids in `exclude`, or None.
    `on_accepted(seconds)` is told how long admission took (the queue-time metric);
    `on_migrated()` that a request continues on another worker (the migrations metric).
    `router_id` names this router's stream subjects (unique per router process).
    `instance` is this router process's id (services/router/dispatch/heartbeat.py): every request
    and cancel carries it, and workers key requests by (instance, request id).
    """

    def __init__(
        self,
        bus: Bus,
        prefix: str,
        workers: WorkerTable,
        request_timeout: float,
        queue_timeout: float,
        *,
        on_accepted: Callable[[float], None] = lambda _s: None,
        on_migrated: Callable[[], None] = lambda: None,
        lost_after: float = 3.0,
        router_id: str = "",
        instance: str = "",
    ):
        self.bus, self.prefix, self.workers = bus, prefix, workers
        self.request_timeout, self.queue_timeout = request_timeout, queue_timeout
        self.on_accepted, self.on_migrated = on_accepted, on_migrated
        self.lost_after = lost_after
        self.reconnected_at = 0.0  # time.monotonic() of the bus's last reconnect
        self.streams = StreamTable(bus, prefix, router_id or uuid.uuid4().hex[:16])
        self.instance = instance
        self._waiting: set[_Stream] = set()  # accepted streams, checked by the sweeper
        self._sweeper: asyncio.Task | None = None
        bus.on_reconnect(self._on_reconnect)

    async def _on_reconnect(self) -> None:
        self.reconnected_at = time.monotonic()

    async def run(
        self,
        request_id: str,
        token_ids: list[int],
        sampling: SamplingSpec,
        route: Callable[[set[str]], Route | None],
        timeout: float,
        sink: Sink,
        *,
        label: str = "",
    ) -> None:
        """`request_id` is router-local (unique in this process); `label` the client's
        X-Request-Id, carried to the workers for their logs only."""
        start = time.monotonic()
        deadline = start + timeout
        gen = Generation(token_ids, sampling, sink)
        failed: set[str] = set()  # workers that failed this request
        error: WorkerFailed | None = None
        retried, pause, tries = False, 0.05, 0
        waiting_since = start  # --queue-timeout counts from here (again after a failure)
        while True:
            chosen = next_route(route, failed, gen, error)
            if gen.migrating:  # counted once per failure, not per busy retry after it
                gen.migrating = False
                self.on_migrated()
            tries += 1
            rid = request_id if tries == 1 else f"{request_id}-r{tries - 1}"
            try:
                await self._attempt(rid, gen, chosen, deadline, label=label)
                return
            except WorkerBusy:
                # Full KV pools are back-pressure: wait for room, up to --queue-timeout.
                if time.monotonic() + pause > min(deadline, waiting_since + self.queue_timeout):
                    raise ApiError(
                        429, "every decode worker is full (KV pages, prefill backlog); retry",
                        code="workers_full", headers={"Retry-After": "1"},
                    ) from None  # fmt: skip
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1.0)
                continue
            except WorkerFailed as e:
                error, waiting_since, pause = e, time.monotonic(), 0.05
                failed |= {chosen.decode, chosen.prefill} - {""}
                if gen.sent:  # the client has output: continue it elsewhere (migrate)
                    gen.migrations += 1
                    gen.migrating = True
                    log.warning("request migrates", error=str(e), route=chosen.decode,
                                generated=len(gen.sent))  # fmt: skip
                    continue
                if retried:
                    # Nothing was produced and two routes failed (dead, or too slow to
                    # answer under overload): the client may simply try again later.
                    raise ApiError(
                        503, f"no worker could take the request now: {e}",
                        code="workers_unavailable", headers={"Retry-After": "1"},
                    ) from None  # fmt: skip
                log.warning("retrying on another worker", error=str(e), route=chosen.decode)
                retried = True

    async def generate(
        self,
        request_id: str,
        token_ids: list[int],
        sampling: SamplingSpec,
        route: Callable[[set[str]], Route | None],
        timeout: float,
    ) -> AsyncIterator[TokenChunk]:
        """`run`'s chunks as an async generator; close it (`contextlib.aclosing`) to cancel."""
        queue: asyncio.Queue = asyncio.Queue()
        end = object()
        task = asyncio.create_task(
            self.run(request_id, token_ids, sampling, route, timeout, queue.put_nowait)
        )
        task.add_done_callback(lambda _t: queue.put_nowait(end))
        try:
            while (item := await queue.get()) is not end:
                yield item
            task.result()  # raises what ended the run
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _attempt(
        self, rid: str, gen: Generation, route: Route, deadline: float, *, label: str = ""
    ) -> None:
        """One try on `route`, in a span (a migration's try: continued_after > 0)."""
        with tracing.span("router.attempt", label or rid, attempt=rid, decode=route.decode,
                          prefill=route.prefill, continued_after=len(gen.sent)):  # fmt: skip
            await self._try(rid, gen, route, deadline, label=label)

    async def _try(
        self, rid: str, gen: Generation, route: Route, deadline: float, *, label: str = ""
    ) -> None:
        try:
            if not self.streams.ready:  # the router's first request subscribes: a NATS
                with tracing.span("router.subscribe", label or rid):  # round trip
                    await self.streams.start()
        except Exception as e:  # no connection: nothing was sent, another try may work
            raise WorkerFailed(f"cannot subscribe to token streams: {e}", False) from None
        decode = self.workers.get(route.decode)
        prefill = self.workers.get(route.prefill) if route.prefill else None
        pending = len(gen.token_ids)
        if prefill is not None:  # what it must compute: its cached prefix pages are not work
            pending = max(1, pending - route.cached_pages * prefill.report.page_size)
            prefill.pending_prefill_tokens += pending
        stream = _Stream(gen.deliver, route, deadline, prefill, pending, len(gen.sent))
        rid, subject = self.streams.open(rid, stream.on_chunk)
        if decode is not None:
            decode.inflight.add(rid)
            stream.decode_instance = decode.report.instance
        try:
            request = GenerateRequest(
                request_id=rid,
                token_ids=gen.token_ids,
                sampling=gen.sampling,
                stream_subject=subject,
                prefill_worker=route.prefill,
                timeout=max(1.0, deadline - time.monotonic()),
                batch_subject=self.streams.batch_subject,
                router=self.instance,
                label=label,
                generated=list(gen.sent),
            )
            sent = time.monotonic()
            try:
                with tracing.span("router.accept", label or rid):
                    await self.bus.request(
                        f"{self.prefix}.decode.{route.decode}.generate",
                        request,
                        GenerateAccepted,
                        timeout=min(self.request_timeout, max(0.1, deadline - sent)),
                    )
            except RemoteError as e:
                if e.code == 429:
                    raise WorkerBusy(e.message) from None
                if 400 <= e.code < 500:
                    raise ApiError(400, f"refused by the worker: {e.message}") from None
                raise WorkerFailed(f"decode worker {route.decode}: {e.message}", False) from None
            except BusError as e:
                raise WorkerFailed(str(e), False) from None
            self.on_accepted(time.monotonic() - sent)
            self._waiting.add(stream)
            if self._sweeper is None or self._sweeper.done():
                self._sweeper = asyncio.create_task(self._sweep(), name="stream-sweeper")
            with tracing.span("router.stream", label or rid) as span:
                stream.span = span
                await stream.done
                if span is not None:
                    span.set_attribute("tandem.chunks", stream.delivered)
        finally:
            self._waiting.discard(stream)
            stream.settle()
            if decode is not None:
                decode.inflight.discard(rid)
            self.streams.close(rid)
            if not stream.ended:
                cancel = CancelRequest(
                    request_id=rid, reason="router ended the request", router=self.instance
                )
                await _quietly(self.bus.publish(f"{self.prefix}.cancel", cancel))

    async def _sweep(self) -> None:
        """Every `_POLL_S`, while streams wait: each one's deadline, that its route's
        workers still report, that its order still moves. One timer for all streams, none
        per stream or per chunk; a stream that fails here ends with the reason."""
        while self._waiting:
            asked = time.monotonic() + _POLL_S
            await asyncio.sleep(_POLL_S)
            now = time.monotonic()
            if now - asked > _POLL_S:  # this loop stalled: the chunks queued meanwhile first
                continue
            for stream in list(self._waiting):
                try:
                    if now >= stream.deadline:
                        raise ApiError(504, "the request took longer than the router's timeout")
                    self._check_alive(stream.route, stream)
                    self._check_lost(stream)
                except Exception as e:
                    stream.fail(e)

    async def stop(self) -> None:
        """Stop the sweeper and the stream subscriptions (safe to call twice)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.streams.stop()

    def _check_lost(self, stream: _Stream) -> None:
        """Both workers are live, yet the stream cannot move on: chunks were lost."""
        order, streamed = stream.order, stream.delivered > 0
        now, next_index, moved = time.monotonic(), order.next_index, order.moved
        if order.held and now - moved > self.lost_after:
            raise WorkerFailed(f"token chunk {next_index} lost in transit", streamed)
        since = max(moved, self.reconnected_at)
        if next_index and moved < self.reconnected_at and now - since > self.lost_after:
            raise WorkerFailed("the stream went silent across a NATS reconnect", True)

    def _check_alive(self, route: Route, stream: _Stream) -> None:
        streamed = stream.delivered > 0
        if not self.workers.is_live(route.decode):
            raise WorkerFailed(f"decode worker {route.decode} stopped reporting", streamed)
        if not self.workers.is_live(route.decode, stream.decode_instance):
            raise WorkerFailed(f"decode worker {route.decode} restarted", streamed)
        if route.prefill and not streamed and not self.workers.is_live(route.prefill):
            raise WorkerFailed(f"prefill worker {route.prefill} stopped reporting", False)


async def _quietly(awaitable) -> None:
    try:
        await asyncio.wait_for(awaitable, timeout=2)
    except Exception as e:  # the connection may be gone; the request's timeout still frees it
        log.debug("cleanup step failed", error=str(e) or type(e).__name__)
