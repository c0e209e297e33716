"""The decode worker: reserves pages, takes the prompt's KV from a prefill worker, generates.

    generate (tandem.decode.<id>.generate)
      no prefill worker named -> prefill here too, stream from token 0
      a continuation (`generated`: a request migrated from a dead worker) -> prefill the
            prompt and those tokens here, replay them (grammar, stops), stream after them
      else: reserve pages -> PrefillRequest to that worker (it writes the KV into them and
            streams token 0) -> verify PrefillResult.check -> decode from token 1
    cancel (tandem.cancel) -> abort wherever the request is; its pages are freed

Errors after the request was accepted end its stream with finish_reason "error"; the
reservation is always released (by abort) whatever happens, and never before the handoff's
own region is unregistered (`_handoff_region`): a late write cannot reach freed pages.
"""

from __future__ import annotations

import asyncio
import time

from libs.common.bus.connection import BusError, Endpoint, HandlerError
from libs.common.config import WorkerConfig
from libs.common.log import get_logger, request_context
from libs.common.messages.control import (
    GenerateAccepted,
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
    RequestStatus,
    RequestStatusReply,
    Usage,
)
from libs.common.transfer import RegionBusy, RegionDescriptor
from libs.common.worker.backlog import PromptBacklog
from libs.common.worker.core import WorkerService, logprobs_wire, sampling_params
from libs.common.worker.handoff.protocol import KvLayout, handoff_check, page_ranges
from libs.common.worker.handoff.receiver import verify_kv
from libs.common.worker.router_watch import request_key
from libs.common.worker.token_publisher import ChunkBatcher, TokenStream

log = get_logger(__name__)


class DecodeService(WorkerService):
    """A model replica that receives prompt KV into reserved pages and generates tokens."""

    description = "Tandem decode worker"
    role = "decode"

    def __init__(self, config: WorkerConfig):
        super().__init__(config)
        self.config: WorkerConfig = config
        self._prefill_seen: dict[str, float] = {}  # worker -> its last load report
        self.backlog = PromptBacklog()  # admission by expected prefill wait
        self._region_freed = asyncio.Condition()  # a handoff region was unregistered
        self.batcher = ChunkBatcher(self.bus, config.service_id)  # one message per step

    async def on_start(self) -> None:
        await super().on_start()
        # Prefill peers are `prefill` or `both` workers: any worker's report says it lives.
        subject = self.subject("workers", "*", "*", "load")
        await self.bus.subscribe(subject, self._on_peer_load)  # ends with the connection

    async def _on_peer_load(self, msg) -> None:
        self._prefill_seen[msg.subject.split(".")[-2]] = time.monotonic()

    def endpoints(self) -> list[Endpoint]:
        return [
            Endpoint(
                name="generate",
                subject=self.subject("decode", self.config.service_id, "generate"),
                request_type=GenerateRequest,
                handler=self._generate,
                concurrent=True,
            )
        ]

    async def _generate(self, req: GenerateRequest) -> GenerateAccepted:
        key = request_key(req.router, req.request_id)  # the engine's id for it too
        with request_context(req.request_id, router=req.router, label=req.label):
            try:
                params = sampling_params(req.sampling)
            except ValueError as e:
                raise HandlerError(400, f"sampling: {e}") from None
            if key in self._active:
                raise HandlerError(409, f"request {req.request_id} is already running here")
            limit = self.config.max_queue_delay
            wait = self.backlog.expected_wait(len(req.token_ids))
            if limit and wait > limit:
                raise HandlerError(429, f"prefill backlog: a new prompt would wait ~{wait:.0f}s "
                                        f"(--max-queue-delay {limit:g})")  # fmt: skip
            pages: list[int] = []
            held = 0
            if req.prefill_worker and not req.generated:  # a continuation prefills here
                try:
                    reserved = await self.engine.reserve_reusing_prefix(key, req.token_ids, params)
                except ValueError as e:
                    raise HandlerError(400, str(e)) from None
                if reserved is None:
                    raise HandlerError(429, "KV pool full: no pages for this prompt now")
                pages, held = reserved  # the first `held` pages are cached here: not sent
                run = self._run_disaggregated(req, pages, held)
            else:
                run = self._run_local(req, params)
            if self.was_cancelled(key):  # the router gave up while we reserved
                if pages:
                    await self.engine.abort(key)
                raise HandlerError(499, "request cancelled before it was accepted")
            self.queued_prompt_tokens += len(req.token_ids)
            self.backlog.add(len(req.token_ids))
            task = self.bus.spawn(self._guard(req, run), name=f"decode-{key}")
            self.hold(key, req.router, task)
            task.add_done_callback(lambda _t: self.release(key))
            log.info("request accepted", prompt_tokens=len(req.token_ids), pages=len(pages),
                     prefill_worker=req.prefill_worker if pages else "self",
                     continued_after=len(req.generated))  # fmt: skip
            return GenerateAccepted(
                request_id=req.request_id,
                decode_worker=self.config.service_id,
                num_reserved_pages=len(pages),
                num_held_pages=held,
            )

    async def _guard(self, req: GenerateRequest, run) -> None:
        """Run a request to its end; any failure ends the stream with an error."""
        stream = TokenStream(self.bus, req.stream_subject, req.request_id,
                             self.config.service_id, next_index=len(req.generated),
                             batcher=self.batcher,
                             batch_subject=req.batch_subject)  # fmt: skip
        counted = False
        key = request_key(req.router, req.request_id)

        def prompt_done() -> None:  # its prompt no longer waits: stop counting it as load
            nonlocal counted
            if not counted:
                counted = True
                self.queued_prompt_tokens -= len(req.token_ids)
                self.backlog.done(len(req.token_ids))

        with request_context(req.request_id, router=req.router, label=req.label):
            try:
                async with asyncio.timeout(req.timeout):
                    await run(stream, prompt_done)
            except asyncio.CancelledError:
                await self.engine.abort(key)
                await stream.finish("abort", None, "request cancelled")
                raise
            except Exception as e:  # every failure must reach the client
                reason = "timed out" if isinstance(e, TimeoutError) else str(e)
                log.warning("request failed", error=reason)
                await self.engine.abort(key)
                await stream.finish("error", None, reason or type(e).__name__)
            finally:
                prompt_done()

    def _run_local(self, req: GenerateRequest, params):
        async def run(stream: TokenStream, prompt_done) -> None:
            pool_tokens = 0
            tokens = req.token_ids + req.generated
            if self.pool is not None:  # L1 first, then the pool
                keys = self.page_keys(tokens, self.reusable(tokens, params, req.generated))
                _, from_pool = await self.pool.fetch_prefix(keys)
                pool_tokens = from_pool * self.config.page_size
            key = request_key(req.router, req.request_id)
            outputs = self.engine.add_request(req.token_ids, params, request_id=key,
                                              generated=req.generated)  # fmt: skip
            await self._pump(req, stream, outputs, pool_tokens=pool_tokens,
                             prompt_done=prompt_done, skip_first=False)  # fmt: skip

        return run

    def _run_disaggregated(self, req: GenerateRequest, pages: list[int], held: int):
        async def run(stream: TokenStream, prompt_done) -> None:
            result = await self._handoff(req, pages[held:], held)
            prompt_done()
            key = request_key(req.router, req.request_id)
            if result.finish_reason is not None:  # the prefill worker ended the stream
                await self.engine.abort(key)
                return
            stream.next_index = 1
            outputs = self.engine.decode_imported(key, result.first_token)
            await self._pump(req, stream, outputs, prefilled=result.cached_tokens,
                             prompt_done=prompt_done, skip_first=True)  # fmt: skip

        return run

    async def _handoff_region(self, pages: list[int]) -> RegionDescriptor:
        """A write capability on the KV pool's `pages` only (their slices in every layer),
        under an id and token for one handoff only (TransferEngine.grant).

        It is unregistered the moment the handoff ends, however it ends (done, failed,
        cancelled, timed out, prefill worker silent), before the pages are freed: a prefill
        worker that writes late (slow, paused, partitioned, or its cancel not seen yet) is
        refused by the transfer engine instead of overwriting pages that may already hold
        another request's KV. shm holds 1023 regions per segment: when every slot is in
        use the handoff waits for one (never unfenced). rdma registers memory with the
        NIC, too slow per request: it uses the pool's shared descriptor (unfenced; see
        docs/reliability.md).
        """
        if self.transfer.transport == "rdma":
            return self.kv_region
        kv = self.engine.core.kv_cache
        ranges = page_ranges(KvLayout(kv.num_layers, kv.num_pages, kv.slice_nbytes), pages)
        ttl = self.config.handoff_timeout + 5.0  # revoked at the handoff's end; a backstop
        async with self._region_freed:
            while True:
                try:
                    return self.transfer.grant(self.kv_region, ranges, "write", ttl)
                except ValueError as e:  # shm: every slot of the segment in use
                    log.warning("handoff waits for a region slot", error=str(e))
                    await self._region_freed.wait()

    async def _end_handoff(self, region: RegionDescriptor, key: str) -> None:
        if region.region_id == self.kv_region.region_id or self.transfer is None:
            return
        try:
            self.transfer.unregister(region)  # the fence: no late write lands after it
        except RegionBusy:
            # A peer's write could not be stopped (frozen mid-copy): those pages may
            # still change, so they never serve anyone again.
            await self.engine.abort(key, retire_pages=True)
            log.error("handoff pages retired: the prefill worker's write did not end",
                      request_key=key)  # fmt: skip
            raise RuntimeError("KV handoff could not be fenced; its pages are retired") from None
        finally:
            async with self._region_freed:
                self._region_freed.notify()

    async def _handoff(self, req: GenerateRequest, pages: list[int], held: int) -> PrefillResult:
        """Ask the prefill worker to write prompt pages `held..` into `pages` (through a
        region that accepts writes only while this handoff lasts)."""
        region = await self._handoff_region(pages)
        try:
            result = await self._ask_prefill(req, pages, held, region)
        finally:
            await self._end_handoff(region, request_key(req.router, req.request_id))
        if result.finish_reason is None:  # fenced above: no byte lands after the check
            await verify_kv(self, req, pages, result)
        return result

    async def _ask_prefill(
        self, req: GenerateRequest, pages: list[int], held: int, region: RegionDescriptor
    ) -> PrefillResult:
        kv = self.engine.core.kv_cache
        prefill = PrefillRequest(
            request_id=req.request_id,
            token_ids=req.token_ids,
            sampling=req.sampling,
            stream_subject=req.stream_subject,
            decode_worker=self.config.service_id,
            kv_region=region.to_dict(),
            page_indices=pages,
            skip_pages=held,
            model_id=self.model_id,
            page_size=self.config.page_size,
            kv_dtype=self.kv_dtype,
            kv_num_pages=kv.num_pages,
            timeout=req.timeout,
            router=req.router,
        )
        subject = self.subject("prefill", req.prefill_worker, "prefill")
        call = asyncio.ensure_future(
            self.bus.request(subject, prefill, PrefillResult, timeout=self.config.handoff_timeout)
        )
        watch = asyncio.ensure_future(self._watch_prefill(req))
        try:
            await asyncio.wait({call, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not call.done():
                raise RuntimeError(f"prefill worker {req.prefill_worker} {watch.result()}")
            result = call.result()
        except BusError as e:
            raise RuntimeError(f"prefill on {req.prefill_worker} failed: {e}") from None
        finally:
            call.cancel()
            watch.cancel()
        want = handoff_check(req.token_ids, pages, result.first_token)
        if result.request_id != req.request_id or result.check != want:
            raise RuntimeError(f"KV handoff from {req.prefill_worker} failed its check")
        return result

    async def _watch_prefill(self, req: GenerateRequest) -> str:
        """Returns (why) when waiting for `worker`'s PrefillResult is pointless: it sent no
        load report for --peer-timeout (dead, or never there), or it answered twice,
        --peer-timeout apart, that the request is no longer in flight there (its reply was
        lost, e.g. in a NATS restart). Waiting out --handoff-timeout would only hold pages."""
        worker = req.prefill_worker
        since = time.monotonic()
        next_probe, gone = since + self.config.peer_timeout, 0
        while True:
            await asyncio.sleep(min(0.5, self.config.peer_timeout / 2))
            now = time.monotonic()
            last = self._prefill_seen.get(worker, since)  # never seen: count from now
            if now - last > self.config.peer_timeout:
                return f"stopped reporting (silent for {self.config.peer_timeout:g}s)"
            if now >= next_probe:
                next_probe = now + self.config.peer_timeout
                gone = gone + 1 if not await self._prefill_active(worker, req) else 0
                if gone >= 2:
                    return "no longer has the request and its reply never came (lost)"

    async def _prefill_active(self, worker: str, req: GenerateRequest) -> bool:
        """Whether `worker` says `req` is in flight there; True when it cannot tell."""
        subject = self.subject("prefill", worker, "status")
        try:
            ask = RequestStatus(request_id=req.request_id, router=req.router)
            reply = await self.bus.request(
                subject, ask, RequestStatusReply, timeout=self.config.peer_timeout
            )
        except BusError:  # an older worker, or a slow one: the load reports decide
            return True
        return reply.active

    async def _pump(
        self, req, stream, outputs, *, prompt_done, skip_first, prefilled=None, pool_tokens=0
    ) -> None:
        """Publish a request's outputs; the last chunk carries usage. `prefilled` is the
        prefill worker's cached-token count by tier; without one the prompt ran here, with
        `pool_tokens` of its cached tokens read from the pool."""
        first, generated = True, list(req.generated)
        async for out in outputs:
            if first:
                prompt_done()
            ids, text, lps = out.token_ids, out.text, logprobs_wire(out.logprobs)
            if first and skip_first:  # token 0 (and its text) came from the prefill worker
                ids, text, lps = ids[1:], "", lps[1:]
            first = False
            generated += out.token_ids
            self.count_output_tokens(len(ids))
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
                await stream.finish(out.finish_reason or "stop", usage)
                # the next turn of this conversation starts with these pages: pool them
                # (the last token was sampled, never computed, so it has no KV yet)
                tokens = req.token_ids + generated
                self.write_back(tokens, len(tokens) - 1)
                log.info("request finished", reason=out.finish_reason,
                         completion_tokens=out.num_output_tokens)  # fmt: skip
                return
