"""The asyncio face of the engine: requests in, streams of outputs back.

One background task drives `EngineCore.step()` (step_loop.py) in one worker thread (the
model's math releases the GIL, so the event loop keeps serving the bus while a
step runs). Every other call that touches the core (add, abort, reserve,
import/export, release) takes the same lock, so none runs between a step's
schedule and its postprocess.

    engine = Engine(EngineConfig(...)); await engine.start()
    async for out in engine.add_request(ids, SamplingParams(max_tokens=64)):
        ...                                    # RequestOutput deltas
    await engine.stop()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog
import torch

from libs.common.engine.config import EngineConfig
from libs.common.engine.core.outputs import RequestOutput
from libs.common.engine.core.radix_cache import CacheEvent
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.load.tokenizer import TextTokenizer
from libs.common.engine.model.model import LlamaModel
from libs.common.engine.step_loop import EngineCore

log = structlog.get_logger(__name__)


class Engine:
    """Async engine for one worker. See the module docstring for the threading model.

    Contract:
    - `add_request(...)` is an async generator: iterating it queues the request
      and yields RequestOutput deltas until one has `finished`; closing it
      early (`aclose()`, `contextlib.aclosing`, a cancelled consumer, or its
      garbage collection after a `break`) aborts the request and frees its
      pages;
    - `abort(request_id)` ends a request in any state (queued, running, held,
      reserved); its stream ends with finish_reason "abort";
    - prefill-only requests stop after their first token and keep their pages
      (the final output's `page_table`) until `release(request_id)`;
    - `reserve` + (peer writes KV / `import_pages`) + `decode_imported` starts
      decoding from KV computed elsewhere;
    - `on_kv_event(event)` is called on the event loop, in order, for every
      change of the prefix cache (stored / removed page keys, with tier);
    - `stop()` aborts what is left and is safe to call twice;
    - `kv_allocator(nbytes)`, when given, provides the KV pool's memory (a buffer from
      the transfer engine, so peers can reach the pages).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        model: LlamaModel | None = None,
        tokenizer: TextTokenizer | None = None,
        on_kv_event: Callable[[CacheEvent], None] | None = None,
        kv_allocator: Callable[[int], Any] | None = None,
    ) -> None:
        self.config = config
        self._kv_allocator = kv_allocator
        self._model, self._tokenizer = model, tokenizer
        self.on_kv_event = on_kv_event
        self.core: EngineCore | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop_task: asyncio.Task | None = None
        self._ids = itertools.count()

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model (in the worker thread) and start the step loop."""
        if self._loop_task is not None:
            return
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        loop = asyncio.get_running_loop()
        self.core = await loop.run_in_executor(
            self._pool,
            lambda: EngineCore(self.config, self._model, self._tokenizer, self._kv_allocator),
        )
        self._loop_task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for request_id in list(self._streams):
            self._end(request_id, RequestOutput(request_id, [], "", True, "abort"))
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.core is not None:
            self.core.close()

    @property
    def tokenizer(self) -> TextTokenizer | None:
        return self.core.tokenizer if self.core is not None else self._tokenizer

    # -- requests ---------------------------------------------------------------------

    async def add_request(
        self,
        token_ids: list[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        prefill_only: bool = False,
        keep_pages: bool = False,
        generated: list[int] | tuple[int, ...] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Run a request; yields its outputs. See the class contract. `generated`: the
        completion's first tokens, made elsewhere (EngineCore.add): outputs start after
        them, and a request they already end yields one final output without tokens."""
        core = self._require()
        request_id = request_id or f"req-{next(self._ids)}"
        matcher = await self._matcher(sampling)
        queue = self._open(request_id)
        try:
            async with self._lock:
                ended = core.add(
                    request_id,
                    list(token_ids),
                    sampling,
                    prefill_only=prefill_only,
                    keep_pages=keep_pages,
                    matcher=matcher,
                    generated=generated,
                )
                self._flush_events()
            if ended is not None:
                queue.put_nowait(ended)
            self._wake.set()
            async for out in self._drain(request_id, queue):
                yield out
        finally:
            await self._abandon(request_id)

    async def reserve(
        self, request_id: str, token_ids: list[int], sampling: SamplingParams
    ) -> list[int] | None:
        """Reserve pages for a prompt whose KV a peer will write; None when full."""
        matcher = await self._matcher(sampling)
        async with self._lock:
            return self._require().reserve(request_id, list(token_ids), sampling, False, matcher)

    async def reserve_reusing_prefix(
        self, request_id: str, token_ids: list[int], sampling: SamplingParams
    ) -> tuple[list[int], int] | None:
        """As `reserve`, reusing this pool's cached prefix: (pages, n) where the first n
        pages already hold the prompt's KV, so a peer writes only pages[n:]."""
        matcher = await self._matcher(sampling)
        async with self._lock:
            return self._require().reserve(request_id, list(token_ids), sampling, True, matcher)

    async def decode_imported(
        self, request_id: str, first_token_id: int
    ) -> AsyncIterator[RequestOutput]:
        """Start decoding a reserved request whose prompt KV is now in its pages.

        Yields the output of `first_token_id` (sampled by the prefill worker),
        then the rest, as add_request does."""
        core = self._require()
        queue = self._open(request_id)
        try:
            async with self._lock:
                first = core.add_imported(request_id, first_token_id)
                self._flush_events()
            queue.put_nowait(first)
            self._wake.set()
            async for out in self._drain(request_id, queue):
                yield out
        finally:
            await self._abandon(request_id)

    async def abort(self, request_id: str, retire_pages: bool = False) -> None:
        """End a request in any state; `retire_pages`: see Scheduler.abort."""
        async with self._lock:
            out = self._require().abort(request_id, retire_pages)
            self._flush_events()
        if request_id in self._streams:
            self._end(request_id, out or RequestOutput(request_id, [], "", True, "abort"))

    async def release(self, request_id: str) -> None:
        """Free the pages a finished prefill-only / keep_pages request held."""
        async with self._lock:
            self._require().release(request_id)
            self._flush_events()

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(core, *args)` in the engine thread between steps (see cache_io.py)."""
        core = self._require()
        async with self._lock:
            try:
                return await asyncio.get_running_loop().run_in_executor(
                    self._pool, lambda: fn(core, *args)
                )
            finally:
                self._flush_events()

    async def export_pages(self, page_ids: list[int]) -> torch.Tensor:
        """A copy of pages' KV, [n, layers, 2, page_size, kv_heads, head_dim]."""
        async with self._lock:
            return self._require().kv_cache.export_pages(page_ids)

    async def import_pages(self, page_ids: list[int], data: torch.Tensor) -> None:
        """Write KV (shaped as export_pages returns) into reserved pages."""
        async with self._lock:
            self._require().kv_cache.import_pages(page_ids, data)

    # -- internals ----------------------------------------------------------------------

    def _require(self) -> EngineCore:
        if self.core is None:
            raise RuntimeError("engine is not started")
        return self.core

    async def _matcher(self, sampling: SamplingParams) -> Any:
        """The request's grammar matcher, compiled (or found in the cache) off the event
        loop and outside the engine's lock; None without a grammar. ValueError
        (GrammarError) when the grammar does not compile."""
        if not sampling.grammar:
            return None
        return await self._require().grammars.matcher_async(sampling.grammar)

    def _open(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = queue
        return queue

    async def _drain(self, request_id, queue) -> AsyncIterator[RequestOutput]:
        while True:
            out = await queue.get()
            yield out
            if out.finished:
                self._streams.pop(request_id, None)
                return

    async def _abandon(self, request_id: str) -> None:
        # The consumer left before the end (or the stream ended): make sure the
        # request is not left running. Shielded so a cancelled consumer still frees.
        if self._streams.pop(request_id, None) is not None and self.core is not None:
            await asyncio.shield(self._abort_quietly(request_id))

    async def _abort_quietly(self, request_id: str) -> None:
        async with self._lock:
            self._require().abort(request_id)
            self._flush_events()

    def _end(self, request_id: str, out: RequestOutput) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait(out)

    def _flush_events(self) -> None:
        events = self.core.take_events() if self.core is not None else []
        if self.on_kv_event is not None:
            for event in events:
                try:
                    self.on_kv_event(event)
                except Exception:
                    log.exception("engine.kv_event_callback_failed")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        core = self._require()
        while True:
            if not core.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._lock:
                try:
                    outputs = await loop.run_in_executor(self._pool, core.step)
                except Exception:
                    # One bad step must not kill the loop serving everyone else:
                    # fail the requests of this step and go on.
                    log.exception("engine.step_failed")
                    outputs = []
                    for request_id in list(self._streams):
                        out = core.abort(request_id)
                        self._end(
                            request_id, out or RequestOutput(request_id, [], "", True, "abort")
                        )
                self._flush_events()
            for out in outputs:
                self._end(out.request_id, out)
            await asyncio.sleep(0)  # let queued commands take the lock between steps
