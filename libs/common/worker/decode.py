"""The decode role: reserve pages, take the prompt's KV from a prefill worker, generate.

    generate (tandem.decode.<id>.generate)
      admission: 409 when the request already runs here, 429 when the prompt backlog
            would make it wait past --max-queue-delay (backlog.py) or no pages are free
      no prefill worker named -> prefill here too, stream from token 0
      a continuation (`generated`: a request migrated from a dead worker) -> prefill the
            prompt and those tokens here, replay them (grammar, stops), stream after them
      else: reserve pages -> the KV handoff (handoff/receiver.py: the prefill worker writes
            the KV into them and streams token 0) -> decode from token 1
    cancel (tandem.cancel, WorkerCore) -> abort wherever the request is; its pages are freed

Errors after the request was accepted end its stream with finish_reason "error"; the
reservation is always released (by abort) whatever happens, and never before the handoff's
own region is revoked: a late write cannot reach freed pages. Tokens leave through
token_publisher.py (one batch per engine step and router).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from libs.common import tracing
from libs.common.bus.connection import Endpoint, HandlerError
from libs.common.engine.core.outputs import RequestOutput
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.log import get_logger, request_context
from libs.common.messages.control import GenerateAccepted, GenerateRequest, Usage
from libs.common.worker.backlog import PromptBacklog
from libs.common.worker.core import WorkerCore
from libs.common.worker.handoff.receiver import HandoffReceiver
from libs.common.worker.phases import DecodeSpans
from libs.common.worker.router_watch import request_key
from libs.common.worker.token_publisher import ChunkBatcher, TokenStream
from libs.common.worker.wire import logprobs_wire, sampling_params

PromptDone = Callable[[], None]
Run = Callable[[TokenStream, PromptDone], Awaitable[None]]

log = get_logger(__name__)


class DecodeRole:
    """Receives prompt KV into reserved pages (or prefills itself) and generates tokens."""

    def __init__(self, core: WorkerCore, max_queue_delay: float) -> None:
        self.core = core
        self.max_queue_delay = max_queue_delay  # seconds; 0: never refuse for the backlog
        self.backlog = PromptBacklog()  # admission by expected prefill wait
        self.batcher = ChunkBatcher(core.bus, core.config.service_id)  # one message per step
        self.receiver = HandoffReceiver(core)

    async def start(self) -> None:
        await self.receiver.start()

    def endpoints(self) -> list[Endpoint]:
        return [
            Endpoint(
                name="generate",
                subject=self.core.subject("decode", self.core.config.service_id, "generate"),
                request_type=GenerateRequest,
                handler=self._generate,
                concurrent=True,
            )
        ]

    async def _generate(self, req: GenerateRequest) -> GenerateAccepted:
        core = self.core
        key = request_key(req.router, req.request_id)  # the engine's id for it too
        with request_context(req.request_id, router=req.router, label=req.label):
            try:
                params = sampling_params(req.sampling)
            except ValueError as e:
                raise HandlerError(400, f"sampling: {e}") from None
            if core.held.serves(key):
                raise HandlerError(409, f"request {req.request_id} is already running here")
            limit = self.max_queue_delay
            wait = self.backlog.expected_wait(len(req.token_ids))
            if limit and wait > limit:
                raise HandlerError(429, f"prefill backlog: a new prompt would wait ~{wait:.0f}s "
                                        f"(--max-queue-delay {limit:g})")  # fmt: skip
            pages: list[int] = []
            held = 0
            if req.prefill_worker and not req.generated:  # a continuation prefills here
                try:
                    reserved = await core.engine.reserve_reusing_prefix(key, req.token_ids, params)
                except ValueError as e:
                    raise HandlerError(400, str(e)) from None
                if reserved is None:
                    raise HandlerError(429, "KV pool full: no pages for this prompt now")
                pages, held = reserved  # the first `held` pages are cached here: not sent
                run = self._run_disaggregated(req, pages, held)
            else:
                run = self._run_local(req, params)
            if core.held.was_cancelled(key):  # the router gave up while we reserved
                if pages:
                    await core.engine.abort(key)
                raise HandlerError(499, "request cancelled before it was accepted")
            core.load.prompt_accepted(len(req.token_ids))
            self.backlog.add(len(req.token_ids))
            task = core.bus.spawn(self._guard(req, run), name=f"decode-{key}")
            core.held.hold(key, req.router, task)
            task.add_done_callback(lambda _t: core.held.release(key))
            log.info("request accepted", prompt_tokens=len(req.token_ids), pages=len(pages),
                     prefill_worker=req.prefill_worker if pages else "self",
                     continued_after=len(req.generated))  # fmt: skip
            return GenerateAccepted(
                request_id=req.request_id,
                decode_worker=core.config.service_id,
                num_reserved_pages=len(pages),
                num_held_pages=held,
            )

    async def _guard(self, req: GenerateRequest, run: Run) -> None:
        """Run a request to its end; any failure ends the stream with an error."""
        stream = TokenStream(self.core.bus, req.stream_subject, req.request_id,
                             self.core.config.service_id, next_index=len(req.generated),
                             batcher=self.batcher,
                             batch_subject=req.batch_subject)  # fmt: skip
        counted = False
        key = request_key(req.router, req.request_id)

        def prompt_done() -> None:  # its prompt no longer waits: stop counting it as load
            nonlocal counted
            if not counted:
                counted = True
                self.core.load.prompt_started(len(req.token_ids))
                self.backlog.done(len(req.token_ids))

        with (
            request_context(req.request_id, router=req.router, label=req.label),
            tracing.span("decode.request", req.request_id, prompt_tokens=len(req.token_ids),
                         continued_after=len(req.generated),  # > 0: a migrated request
                         prefill_worker=req.prefill_worker),
        ):  # fmt: skip
            try:
                async with asyncio.timeout(req.timeout):
                    await run(stream, prompt_done)
            except asyncio.CancelledError:
                await self.core.engine.abort(key)
                await stream.finish("abort", None, "request cancelled")
                raise
            except Exception as e:  # every failure must reach the client
                reason = "timed out" if isinstance(e, TimeoutError) else str(e)
                log.warning("request failed", error=reason)
                await self.core.engine.abort(key)
                await stream.finish("error", None, reason or type(e).__name__)
            finally:
                prompt_done()

    def _run_local(self, req: GenerateRequest, params: SamplingParams) -> Run:
        core = self.core

        async def run(stream: TokenStream, prompt_done: PromptDone) -> None:
            pool_tokens = 0
            tokens = req.token_ids + req.generated
            if core.pool is not None:  # L1 first, then the pool
                reusable = core.reusable(tokens, params, req.generated)
                keys = core.page_keys(tokens, reusable, params.cache_salt)
                with tracing.span("pool.get", req.request_id, pages=len(keys)):
                    _, from_pool = await core.pool.fetch_prefix(keys)
                    tracing.annotate(pages_read=from_pool, bytes=from_pool * core.pool.page_nbytes)
                pool_tokens = from_pool * core.config.page_size
            key = request_key(req.router, req.request_id)
            outputs = core.engine.add_request(req.token_ids, params, request_id=key,
                                              generated=req.generated)  # fmt: skip
            await self._pump(req, stream, outputs, pool_tokens=pool_tokens,
                             prompt_done=prompt_done, skip_first=False)  # fmt: skip

        return run

    def _run_disaggregated(self, req: GenerateRequest, pages: list[int], held: int) -> Run:
        async def run(stream: TokenStream, prompt_done: PromptDone) -> None:
            with tracing.span("kv.handoff", req.request_id, pages=len(pages) - held,
                              held_pages=held):  # fmt: skip
                result = await self.receiver.receive(req, pages[held:], held)
                tracing.annotate(**{f"cached_tokens.{k}": v
                                    for k, v in result.cached_tokens.items()})  # fmt: skip
            prompt_done()
            key = request_key(req.router, req.request_id)
            if result.finish_reason is not None:  # the prefill worker ended the stream
                await self.core.engine.abort(key)
                return
            stream.next_index = 1
            outputs = self.core.engine.decode_imported(key, result.first_token)
            await self._pump(req, stream, outputs, prefilled=result.cached_tokens,
                             prompt_done=prompt_done, skip_first=True)  # fmt: skip

        return run

    async def _pump(
        self,
        req: GenerateRequest,
        stream: TokenStream,
        outputs: AsyncIterator[RequestOutput],
        *,
        prompt_done: PromptDone,
        skip_first: bool,
        prefilled: dict[str, int] | None = None,
        pool_tokens: int = 0,
    ) -> None:
        """Publish a request's outputs; the last chunk carries usage. `prefilled` is the
        prefill worker's cached-token count by tier; without one the prompt ran here, with
        `pool_tokens` of its cached tokens read from the pool."""
        first, generated = True, list(req.generated)
        spans = DecodeSpans(req.request_id, prefilled_here=not skip_first)
        last = arrived = time.monotonic()
        async for out in outputs:
            spans.output(out)
            if first:
                prompt_done()
            ids, text, lps = out.token_ids, out.text, logprobs_wire(out.logprobs)
            if first and skip_first:  # token 0 (and its text) came from the prefill worker
                ids, text, lps = ids[1:], "", lps[1:]
            _observe_latency(self.core, first and not skip_first, len(ids), arrived, last)
            last = time.monotonic() if ids else last
            first = False
            generated += out.token_ids
            self.core.load.count_output_tokens(len(ids))
            if ids or text:
                await stream.add(ids, text, lps, logprobs_wire(out.prompt_logprobs))
            if out.finished:
                if prefilled is not None:
                    cached = dict(prefilled)
                else:
                    pool = min(pool_tokens, out.num_cached_tokens)
                    cached = {"device": out.num_cached_tokens - pool, "pool": pool}
                usage = Usage(
                    prompt_tokens=out.num_prompt_tokens or len(req.token_ids),
                    completion_tokens=out.num_output_tokens,
                    cached_tokens=cached,
                )
                await stream.finish(out.finish_reason or "stop", usage,
                                    stop_reason=out.stop_reason)  # fmt: skip
                spans.finished(out.num_output_tokens)
                # the next turn of this conversation starts with these pages: pool them
                # (the last token was sampled, never computed, so it has no KV yet)
                tokens = req.token_ids + generated
                self.core.write_back(tokens, len(tokens) - 1, req.sampling.cache_salt,
                                     request_id=req.request_id)  # fmt: skip
                log.info("request finished", reason=out.finish_reason,
                         completion_tokens=out.num_output_tokens)  # fmt: skip
                return


def _observe_latency(
    core: WorkerCore, first: bool, tokens: int, arrived: float, last: float
) -> None:
    """A chunk of `tokens` out: its TTFT if it is a prompt's first prefilled here, else
    its tokens' spacing since the chunk before (a handed-over stream's first chunk follows
    token 0 from the prefill worker: no interval of this worker's)."""
    now = time.monotonic()
    if first:
        core.load.ttft.add(now - arrived)
    elif tokens and last > arrived:
        core.load.itl.add((now - last) / tokens, weight=tokens)
