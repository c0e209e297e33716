"""The prefill role: computes a prompt and writes its KV into a decode worker's pages.

services/prefill runs it alone; `--role both` runs it beside the decode role on one core
(service.py).

prefill (tandem.prefill.<id>.prefill), from a decode worker (the KV handoff's sending
half: handoff/sender.py):
  refuse to pair on a different model id / page size / KV dtype (409)
  read what the pool holds beyond this worker's prefix cache into that cache
  run the prompt prefill-only (cached pages are not recomputed), chunk by chunk; each
    chunk's final pages start moving into the decode worker's reserved pages at once
    (transfer engine), overlapping the next chunk's compute
  publish token 0 on the request's stream at once (the client sees it before the
    handoff ends; with the final usage if token 0 already ends the request)
  finish the writes (the last partial page; any page swapped meanwhile is re-sent)
  write the new full pages to the pool in the background (write-through)
  reply PrefillResult with the check value and the MAC (`vouch`); release the pages
    here (full ones stay in the prefix cache for the next prompt that shares them)
status (tandem.prefill.<id>.status): whether a request is in flight here (a decode
  worker's probe while it waits for a PrefillResult)
"""

from __future__ import annotations

import asyncio
import time

from libs.common import tracing
from libs.common.bus.connection import Endpoint, HandlerError
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.log import get_logger, request_context
from libs.common.messages.control import (
    PrefillRequest,
    PrefillResult,
    RequestStatus,
    RequestStatusReply,
    TokenChunk,
    Usage,
)
from libs.common.transfer import RegionDescriptor, TransferError
from libs.common.worker.core import WorkerCore
from libs.common.worker.handoff.protocol import handoff_check
from libs.common.worker.handoff.sender import KvSender, check_pairing, vouch
from libs.common.worker.phases import ChunkSpans
from libs.common.worker.router_watch import request_key
from libs.common.worker.wire import logprobs_wire, sampling_params

log = get_logger(__name__)


class PrefillRole:
    """Computes prompts and hands their KV to a decode worker."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    async def start(self) -> None:
        """Nothing beyond the core's start."""

    def endpoints(self) -> list[Endpoint]:
        core = self.core
        return [
            Endpoint(
                name="prefill",
                subject=core.subject("prefill", core.config.service_id, "prefill"),
                request_type=PrefillRequest,
                handler=self._prefill,
                concurrent=True,
            ),
            Endpoint(
                name="status",
                subject=core.subject("prefill", core.config.service_id, "status"),
                request_type=RequestStatus,
                handler=self._status,
            ),
        ]

    async def _status(self, req: RequestStatus) -> RequestStatusReply:
        active = self.core.held.serves(request_key(req.router, req.request_id))
        return RequestStatusReply(request_id=req.request_id, active=active)

    async def _prefill(self, req: PrefillRequest) -> PrefillResult:
        core = self.core
        key = request_key(req.router, req.request_id)  # the engine's id for it too
        with request_context(req.request_id, router=req.router):
            check_pairing(core, req)
            try:
                params = sampling_params(req.sampling)
                remote = RegionDescriptor.from_dict(req.kv_region)
            except ValueError as e:
                raise HandlerError(400, str(e)) from None
            task = asyncio.current_task()
            if task is None:  # a handler runs in a task; held, a cancel can reach it
                raise RuntimeError("prefill handler called outside a task")
            core.held.hold(key, req.router, task)
            core.load.prompt_accepted(len(req.token_ids))
            try:
                async with asyncio.timeout(req.timeout):
                    return await self._compute_and_send(req, params, remote)
            except asyncio.CancelledError:  # a cancel of this request, not of the service
                raise HandlerError(499, "request cancelled") from None
            except TimeoutError:
                raise HandlerError(504, f"prefill timed out after {req.timeout:g}s") from None
            except TransferError as e:
                raise HandlerError(502, f"KV transfer to {req.decode_worker} failed: {e}") from None
            finally:
                core.load.prompt_started(len(req.token_ids))
                try:
                    if core.started:  # frees its pages; full ones stay cached
                        await core.engine.abort(key)
                finally:
                    # Active until the reply goes: the abort waits for the engine's lock (a
                    # step), and a status probe meanwhile must not call the request lost.
                    core.held.release(key)

    async def _compute_and_send(
        self, req: PrefillRequest, params: SamplingParams, remote: RegionDescriptor
    ) -> PrefillResult:
        try:
            sender = KvSender.for_request(self.core, req, remote)
        except ValueError as e:
            raise HandlerError(400, str(e)) from None
        try:
            return await self._run(req, params, sender)
        except ValueError as e:  # the pages do not fit the decode worker's region
            raise HandlerError(400, f"bad KV target: {e}") from None
        finally:
            sender.cancel()

    async def _run(
        self, req: PrefillRequest, params: SamplingParams, sender: KvSender
    ) -> PrefillResult:
        core, rid = self.core, req.request_id
        arrived = time.monotonic()
        pool_tokens = 0
        if core.pool is not None:  # L1 first, then the pool; at least 1 token is computed
            reusable = core.reusable(req.token_ids, params)
            keys = core.page_keys(req.token_ids, reusable, params.cache_salt)
            with tracing.span("pool.get", rid, pages=len(keys)):
                _, from_pool = await core.pool.fetch_prefix(keys)
                tracing.annotate(pages_read=from_pool, bytes=from_pool * core.pool.page_nbytes)
            pool_tokens = from_pool * core.config.page_size
        last = None
        key = request_key(req.router, req.request_id)
        steps = ChunkSpans(rid)
        async for out in core.engine.add_request(
            req.token_ids, params, request_id=key, prefill_only=True
        ):
            steps.done(out)
            if not out.finished and out.page_table:
                sender.send(out.page_table)  # a chunk is done: move its pages meanwhile
            last = out
        if last is None or not last.token_ids:
            reason = last.finish_reason if last else None
            raise HandlerError(500, f"prefill produced no token (finish reason {reason})")
        first = last.token_ids[0]
        pool_tokens = min(pool_tokens, last.num_cached_tokens)  # unless evicted meanwhile
        cached = {"device": last.num_cached_tokens - pool_tokens, "pool": pool_tokens}
        tracing.annotate(**{f"cached_tokens.{k}": v for k, v in cached.items()})
        finished = last.finish_reason is not None
        core.load.count_output_tokens(1)
        tracing.event("token 0 published")
        await core.bus.publish(
            req.stream_subject,
            TokenChunk(
                request_id=req.request_id,
                index=0,
                token_ids=[first],
                worker=core.config.service_id,
                text=last.text,
                logprobs=logprobs_wire(last.logprobs),
                prompt_logprobs=logprobs_wire(last.prompt_logprobs),
                finish_reason=last.finish_reason,
                stop_reason=last.stop_reason,
                usage=Usage(
                    prompt_tokens=len(req.token_ids), completion_tokens=1, cached_tokens=cached
                )
                if finished
                else None,
            ),
        )
        core.load.ttft.add(time.monotonic() - arrived)  # its first token is out
        kv_mac = ""
        if not finished:
            page_table = last.page_table or []
            with tracing.span("kv.finish", rid):  # the writes still in flight land
                await sender.finish(page_table)  # ValueError unless it holds every prompt page
            local_pages = page_table[sender.skip : sender.num_pages]
            kv_mac = await vouch(core, req, first, local_pages)
        core.write_back(req.token_ids, len(req.token_ids), params.cache_salt, request_id=rid)
        log.info("prefill done", prompt_tokens=len(req.token_ids), cached=cached,
                 finished=finished, pages_sent=len(sender.sent))  # fmt: skip
        return PrefillResult(
            request_id=req.request_id,
            first_token=first,
            check=handoff_check(req.token_ids, req.page_indices, first),
            cached_tokens=cached,
            finish_reason=last.finish_reason,
            kv_mac=kv_mac,
        )
