"""The prefill worker: computes a prompt and writes its KV into a decode worker's pages.

It lives in the library so that both processes that prefill compose it: the prefill
service runs it alone, the `both` role (services/decode/both.py) beside a decode worker.

prefill (tandem.prefill.<id>.prefill), from a decode worker:
  refuse to pair on a different model id / page size / KV dtype (409)
  read what the pool holds beyond this worker's prefix cache into that cache
  run the prompt prefill-only (cached pages are not recomputed), chunk by chunk; each
    chunk's final pages start moving into the decode worker's reserved pages at once
    (transfer engine), overlapping the next chunk's compute
  publish token 0 on the request's stream at once (the client sees it before the
    handoff ends; with the final usage if token 0 already ends the request)
  finish the writes (the last partial page; any page swapped meanwhile is re-sent)
  write the new full pages to the pool in the background (write-through)
  reply PrefillResult with the check value; release the pages here (full ones stay
    in the prefix cache for the next prompt that shares them)
"""

from __future__ import annotations

import asyncio

from libs.common.bus.connection import Endpoint, HandlerError
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
from libs.common.worker.core import WorkerService, logprobs_wire, sampling_params
from libs.common.worker.handoff.protocol import (
    HandoffClaim,
    KvLayout,
    handoff_check,
    handoff_mac,
    handoff_seed,
    pool_digest,
)
from libs.common.worker.handoff.sender import KvSender
from libs.common.worker.router_watch import request_key

log = get_logger(__name__)


class PrefillService(WorkerService):
    """A model replica that computes prompts and hands their KV to a decode worker."""

    description = "Tandem prefill worker"
    role = "prefill"

    def endpoints(self) -> list[Endpoint]:
        return [
            Endpoint(
                name="prefill",
                subject=self.subject("prefill", self.config.service_id, "prefill"),
                request_type=PrefillRequest,
                handler=self._prefill,
                concurrent=True,
            ),
            Endpoint(
                name="status",
                subject=self.subject("prefill", self.config.service_id, "status"),
                request_type=RequestStatus,
                handler=self._status,
            ),
        ]

    async def _status(self, req: RequestStatus) -> RequestStatusReply:
        active = request_key(req.router, req.request_id) in self._active
        return RequestStatusReply(request_id=req.request_id, active=active)

    def _check_pairing(self, req: PrefillRequest) -> None:
        mine = (self.model_id, self.config.page_size, self.kv_dtype)
        theirs = (req.model_id, req.page_size, req.kv_dtype)
        if mine != theirs:
            raise HandlerError(
                409,
                f"cannot pair: decode worker {req.decode_worker} has model/page size/KV dtype "
                f"{theirs}, this prefill worker {self.config.service_id} has {mine}",
            )

    async def _prefill(self, req: PrefillRequest) -> PrefillResult:
        key = request_key(req.router, req.request_id)  # the engine's id for it too
        with request_context(req.request_id, router=req.router):
            self._check_pairing(req)
            try:
                params = sampling_params(req.sampling)
                remote = RegionDescriptor.from_dict(req.kv_region)
            except ValueError as e:
                raise HandlerError(400, str(e)) from None
            self.hold(key, req.router, asyncio.current_task())
            self.queued_prompt_tokens += len(req.token_ids)
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
                self.queued_prompt_tokens -= len(req.token_ids)
                try:
                    if self.engine is not None:  # frees its pages; full ones stay cached
                        await self.engine.abort(key)
                finally:
                    # Active until the reply goes: the abort waits for the engine's lock (a
                    # step), and a status probe meanwhile must not call the request lost.
                    self.release(key)

    def _sender(self, req: PrefillRequest, remote: RegionDescriptor) -> KvSender:
        kv = self.engine.core.kv_cache
        try:
            return KvSender(
                self.transfer, self.kv_region,
                KvLayout(kv.num_layers, kv.num_pages, kv.slice_nbytes),
                remote, KvLayout(kv.num_layers, req.kv_num_pages, kv.slice_nbytes),
                num_prompt_pages=-(-len(req.token_ids) // self.config.page_size),
                skip=req.skip_pages, remote_pages=req.page_indices,
            )  # fmt: skip
        except ValueError as e:
            raise HandlerError(400, str(e)) from None

    async def _compute_and_send(self, req, params, remote: RegionDescriptor) -> PrefillResult:
        sender = self._sender(req, remote)
        try:
            return await self._run(req, params, sender)
        except ValueError as e:  # the pages do not fit the decode worker's region
            raise HandlerError(400, f"bad KV target: {e}") from None
        finally:
            sender.cancel()

    async def _run(self, req, params, sender: KvSender) -> PrefillResult:
        pool_tokens = 0
        if self.pool is not None:  # L1 first, then the pool; at least 1 token is computed
            keys = self.page_keys(req.token_ids, self.reusable(req.token_ids, params))
            _, from_pool = await self.pool.fetch_prefix(keys)
            pool_tokens = from_pool * self.config.page_size
        last = None
        key = request_key(req.router, req.request_id)
        async for out in self.engine.add_request(
            req.token_ids, params, request_id=key, prefill_only=True
        ):
            if not out.finished and out.page_table:
                sender.send(out.page_table)  # a chunk is done: move its pages meanwhile
            last = out
        if last is None or not last.token_ids:
            reason = last.finish_reason if last else None
            raise HandlerError(500, f"prefill produced no token (finish reason {reason})")
        first = last.token_ids[0]
        pool_tokens = min(pool_tokens, last.num_cached_tokens)  # unless evicted meanwhile
        cached = {"device": last.num_cached_tokens - pool_tokens, "pool": pool_tokens}
        finished = last.finish_reason is not None
        self.count_output_tokens(1)
        await self.bus.publish(
            req.stream_subject,
            TokenChunk(
                request_id=req.request_id,
                index=0,
                token_ids=[first],
                worker=self.config.service_id,
                text=last.text,
                logprobs=logprobs_wire(last.logprobs),
                prompt_logprobs=logprobs_wire(last.prompt_logprobs),
                finish_reason=last.finish_reason,
                usage=Usage(
                    prompt_tokens=len(req.token_ids), completion_tokens=1, cached_tokens=cached
                )
                if finished
                else None,
            ),
        )
        kv_mac = ""
        if not finished:
            await sender.finish(last.page_table or [])
            kv_mac = await self._vouch(req, first, last.page_table[sender.skip : sender.num_pages])
        self.write_back(req.token_ids, len(req.token_ids))
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

    async def _vouch(self, req: PrefillRequest, first: int, local_pages: list[int]) -> str:
        """The MAC of what this worker wrote into the decode worker's pages (its own
        copy of the same bytes, still held by the request): "" without a KV secret."""
        if self.kv_mac is None:
            return ""
        kv, key = self.engine.core.kv_cache, self.kv_mac.handoff_key
        seed = handoff_seed(key, req.router, req.request_id, req.decode_worker)
        digest = await asyncio.to_thread(pool_digest, kv, local_pages, seed)
        claim = HandoffClaim(req.router, req.request_id, req.decode_worker, req.token_ids,
                             req.page_indices, first, digest)  # fmt: skip
        return handoff_mac(key, claim)
