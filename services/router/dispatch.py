"""One generation on the workers: send GenerateRequest, read the TokenChunk stream in order.

    generate(rid, ids, sampling, route)                       (an async generator)
      open <rid> in the router's StreamTable (its two subscriptions exist before any
      request goes out, so no chunk is missed; services/router/streams.py)
      GenerateRequest -> tandem.decode.<d>.generate  -> GenerateAccepted (or an error)
      yield TokenChunks in `index` order (they come from two connections, one-by-one and
      in batches: reordered here) until the chunk with finish_reason

Failure handling, in one place:
- the decode worker has no room (429): wait with backoff and route again, up to
  --queue-timeout, then 429 to the client;
- the decode worker refuses (error reply, no responder, no reply in time), a worker on
  the route stops reporting, or the stream ends in an error, *before any token was
  yielded*: retried once on a route that avoids the failed workers (`<rid>-r1`); if
  that fails too, 503 with Retry-After (nothing was produced: safe to retry);
- the same after tokens were yielded: `WorkerFailed`, the caller ends the response;
- chunks lost in transit while both workers are live (a restarted nats-server drops what
  it held, and what is published before the router has subscribed again): a hole in the
  chunk order for `lost_after` seconds, or a started stream silent for `lost_after` since
  the router's last reconnect, is a `WorkerFailed` too, never an endless wait;
- the caller stops iterating (client gone, stop, error), or the time is up:
  `CancelRequest` on `tandem.cancel` so every worker frees the request's pages.
Callers must close the generator (`contextlib.aclosing`) so the cancel is sent at once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

from libs.common.bus import Bus, BusError, RemoteError
from libs.common.log import get_logger
from libs.common.messages import (
    CancelRequest,
    GenerateAccepted,
    GenerateRequest,
    SamplingSpec,
    TokenChunk,
)
from services.router.errors import ApiError
from services.router.policy import Route
from services.router.streams import StreamTable
from services.router.workers import WorkerTable

log = get_logger(__name__)

_POLL_S = 0.25  # how often a waiting stream checks that its workers still report


class WorkerBusy(Exception):
    """The decode worker has no room now (429): wait and route again, not a failure."""


class WorkerFailed(Exception):
    """A worker failed or vanished; `streamed` says whether tokens had gone out."""

    def __init__(self, message: str, streamed: bool):
        super().__init__(message)
        self.streamed = streamed


class Dispatcher:
    """Runs generations over the bus; see the module docstring for the contract.

    `route(exclude)` picks a route avoiding the worker ids in `exclude`, or None.
    `on_accepted(seconds)` is told how long admission took (the queue-time metric).
    `router_id` names this router's stream subjects (unique per router process).
    """

    def __init__(
        self,
        bus: Bus,
        prefix: str,
        workers: WorkerTable,
        request_timeout: float,
        queue_timeout: float,
        on_accepted: Callable[[float], None] = lambda _s: None,
        lost_after: float = 3.0,
        router_id: str = "",
    ):
        self.bus, self.prefix, self.workers = bus, prefix, workers
        self.request_timeout, self.queue_timeout = request_timeout, queue_timeout
        self.on_accepted = on_accepted
        self.lost_after = lost_after
        self.reconnected_at = 0.0  # time.monotonic() of the bus's last reconnect
        self.streams = StreamTable(bus, prefix, router_id or uuid.uuid4().hex[:16])
        bus.on_reconnect(self._on_reconnect)

    async def _on_reconnect(self) -> None:
        self.reconnected_at = time.monotonic()

    async def generate(
        self,
        request_id: str,
        token_ids: list[int],
        sampling: SamplingSpec,
        route: Callable[[set[str]], Route | None],
        timeout: float,
    ) -> AsyncIterator[TokenChunk]:
        start = time.monotonic()
        deadline = start + timeout
        exclude: set[str] = set()
        attempt, pause, tries = 0, 0.05, 0
        while attempt < 2:
            chosen = route(exclude)
            if chosen is None:
                raise ApiError(503, "no decode worker is live", headers={"Retry-After": "1"})
            tries += 1
            rid = request_id if tries == 1 else f"{request_id}-r{tries - 1}"
            streamed = False
            try:
                async for chunk in self._attempt(rid, token_ids, sampling, chosen, deadline):
                    streamed = True
                    yield chunk
                return
            except WorkerBusy:
                # Full KV pools are back-pressure: wait for room, up to --queue-timeout.
                if time.monotonic() + pause > min(deadline, start + self.queue_timeout):
                    raise ApiError(
                        429, "every decode worker is full (KV pages, prefill backlog); retry",
                        code="workers_full", headers={"Retry-After": "1"},
                    ) from None  # fmt: skip
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1.0)
                continue
            except WorkerFailed as e:
                if e.streamed or streamed:
                    msg = f"worker failed mid-request: {e}"
                    raise ApiError(502, msg, code="worker_failed") from None
                if attempt == 1:
                    # Nothing was produced and two routes failed (dead, or too slow to
                    # answer under overload): the client may simply try again later.
                    raise ApiError(
                        503, f"no worker could take the request now: {e}",
                        code="workers_unavailable", headers={"Retry-After": "1"},
                    ) from None  # fmt: skip
                log.warning("retrying on another worker", error=str(e), route=chosen.decode)
                exclude |= {chosen.decode, chosen.prefill} - {""}
                attempt += 1

    async def _attempt(
        self, rid: str, token_ids: list[int], sampling: SamplingSpec, route: Route, deadline: float
    ) -> AsyncIterator[TokenChunk]:
        try:
            await self.streams.start()
        except Exception as e:  # no connection: nothing was sent, another try may work
            raise WorkerFailed(f"cannot subscribe to token streams: {e}", False) from None
        rid, subject, queue = self.streams.open(rid)
        decode = self.workers.get(route.decode)
        prefill = self.workers.get(route.prefill) if route.prefill else None
        finished = False
        if decode is not None:
            decode.inflight.add(rid)
        pending = len(token_ids)
        if prefill is not None:
            prefill.pending_prefill_tokens += pending
        try:
            request = GenerateRequest(
                request_id=rid,
                token_ids=token_ids,
                sampling=sampling,
                stream_subject=subject,
                prefill_worker=route.prefill,
                timeout=max(1.0, deadline - time.monotonic()),
                batch_subject=self.streams.batch_subject,
            )
            sent = time.monotonic()
            try:
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
            async for chunk in self._chunks(queue, route, deadline):
                if prefill is not None and pending:
                    prefill.pending_prefill_tokens -= pending
                    pending = 0
                if chunk.finish_reason in ("error", "abort"):  # abort: a worker shut down
                    reason = chunk.error or f"the worker ended the request ({chunk.finish_reason})"
                    raise WorkerFailed(reason, chunk.index > 0)
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            if prefill is not None and pending:
                prefill.pending_prefill_tokens -= pending
            if decode is not None:
                decode.inflight.discard(rid)
            self.streams.close(rid)
            if not finished:
                cancel = CancelRequest(request_id=rid, reason="router ended the request")
                await _quietly(self.bus.publish(f"{self.prefix}.cancel", cancel))

    async def _chunks(
        self, queue: asyncio.Queue[TokenChunk], route: Route, deadline: float
    ) -> AsyncIterator[TokenChunk]:
        next_index, held = 0, {}
        moved = time.monotonic()  # when the stream last moved on
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ApiError(504, "the request took longer than the router's timeout")
            if not queue.empty():  # a chunk is there: no timer to arm and cancel
                chunk = queue.get_nowait()
            else:
                try:  # asyncio.timeout, not wait_for: no task per chunk on the hot path
                    async with asyncio.timeout(min(_POLL_S, left)):
                        chunk = await queue.get()
                except TimeoutError:
                    self._check_alive(route, next_index)
                    self._check_lost(held, next_index, moved)
                    continue
            if chunk.index < next_index:
                if chunk.finish_reason in ("error", "abort"):
                    # A worker that failed before it knew what others streamed (the decode
                    # worker whose handoff failed after the prefill worker sent token 0)
                    # numbers its error from its own view: it still ends the stream.
                    yield chunk
                    return
                continue  # a duplicate
            held[chunk.index] = chunk
            while next_index in held:
                chunk = held.pop(next_index)
                next_index += len(chunk.token_ids)
                moved = time.monotonic()
                yield chunk
                if chunk.finish_reason is not None:
                    return
                if not chunk.token_ids:
                    break  # an empty non-final chunk cannot advance the order
            self._check_lost(held, next_index, moved)

    def _check_lost(self, held: dict, next_index: int, moved: float) -> None:
        """Both workers are live, yet the stream cannot move on: chunks were lost."""
        now = time.monotonic()
        if held and now - moved > self.lost_after:
            raise WorkerFailed(f"token chunk {next_index} lost in transit", next_index > 0)
        since = max(moved, self.reconnected_at)
        if next_index and moved < self.reconnected_at and now - since > self.lost_after:
            raise WorkerFailed("the stream went silent across a NATS reconnect", True)

    def _check_alive(self, route: Route, next_index: int) -> None:
        if not self.workers.is_live(route.decode):
            raise WorkerFailed(f"decode worker {route.decode} stopped reporting", next_index > 0)
        if route.prefill and next_index == 0 and not self.workers.is_live(route.prefill):
            raise WorkerFailed(f"prefill worker {route.prefill} stopped reporting", False)


async def _quietly(awaitable) -> None:
    try:
        await asyncio.wait_for(awaitable, timeout=2)
    except Exception as e:  # the connection may be gone; the request's timeout still frees it
        log.debug("cleanup step failed", error=str(e) or type(e).__name__)
