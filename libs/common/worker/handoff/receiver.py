"""The decode side of a KV handoff: reserve, grant, ask, revoke, verify.

    receive(req, pages, held)
      grant   a write capability on the reserved `pages` only, for this handoff only
              (`_grant`; rdma: the pool's shared descriptor, unfenced)
      ask     PrefillRequest to the prefill worker the router named; meanwhile watch that
              worker (its load reports, and `status` probes): a dead one, or one that lost
              the request, ends the wait early instead of holding pages to --handoff-timeout
      revoke  unregister the capability, however the handoff ended (`revoke`): the fence,
              no late write lands after it; a write that cannot be stopped retires the pages
      check   PrefillResult.check (the right prompt, pages and token 0)
      verify  with a KV secret, the MAC over the bytes that landed (`verify_kv`)

Any failure raises: the decode role ends the request's stream with an error and frees the
pages (never before the revoke), which never entered the prefix cache.
"""

from __future__ import annotations

import asyncio
import time

from nats.aio.msg import Msg

from libs.common.bus.connection import BusError
from libs.common.log import get_logger
from libs.common.messages.control import (
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
    RequestStatus,
    RequestStatusReply,
)
from libs.common.transfer import RegionBusy, RegionDescriptor
from libs.common.worker.core import WorkerCore
from libs.common.worker.handoff.protocol import (
    HandoffClaim,
    KvLayout,
    handoff_check,
    handoff_seed,
    page_ranges,
    pool_digest,
    verify_handoff,
)
from libs.common.worker.router_watch import request_key

log = get_logger(__name__)


class HandoffForged(RuntimeError):
    """The KV in the reserved pages is not what the prefill worker vouched for."""


class HandoffReceiver:
    """A decode worker's handoffs: the regions it grants and the prefill peers it watches."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        self._prefill_seen: dict[str, float] = {}  # worker -> its last load report
        self._region_freed = asyncio.Condition()  # a handoff region was unregistered

    async def start(self) -> None:
        # Prefill peers are `prefill` or `both` workers: any worker's report says it lives.
        subject = self.core.subject("workers", "*", "*", "load")
        await self.core.bus.subscribe(subject, self._on_peer_load)  # ends with the connection

    async def _on_peer_load(self, msg: Msg) -> None:
        self._prefill_seen[msg.subject.split(".")[-2]] = time.monotonic()

    async def receive(self, req: GenerateRequest, pages: list[int], held: int) -> PrefillResult:
        """Ask the prefill worker to write prompt pages `held..` into `pages` (through a
        region that accepts writes only while this handoff lasts)."""
        region = await self._grant(pages)
        try:
            result = await self._ask_prefill(req, pages, held, region)
        finally:
            await self.revoke(region, request_key(req.router, req.request_id))
        if result.finish_reason is None:  # fenced above: no byte lands after the check
            await verify_kv(self.core, req, pages, result)
        return result

    async def _grant(self, pages: list[int]) -> RegionDescriptor:
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
        core = self.core
        if core.transfer.transport == "rdma":
            return core.kv_region
        kv = core.engine_core.kv_cache
        ranges = page_ranges(KvLayout(kv.num_layers, kv.num_pages, kv.slice_nbytes), pages)
        ttl = core.config.handoff_timeout + 5.0  # revoked at the handoff's end; a backstop
        async with self._region_freed:
            while True:
                try:
                    return core.transfer.grant(core.kv_region, ranges, "write", ttl)
                except ValueError as e:  # shm: every slot of the segment in use
                    log.warning("handoff waits for a region slot", error=str(e))
                    await self._region_freed.wait()

    async def revoke(self, region: RegionDescriptor, key: str) -> None:
        """End a handoff's write capability (the fence); the pages of request `key` are
        retired instead when a peer's write cannot be stopped."""
        core = self.core
        if region.region_id == core.kv_region.region_id or not core.started:
            return
        try:
            core.transfer.unregister(region)  # the fence: no late write lands after it
        except RegionBusy:
            # A peer's write could not be stopped (frozen mid-copy): those pages may
            # still change, so they never serve anyone again.
            await core.engine.abort(key, retire_pages=True)
            log.error("handoff pages retired: the prefill worker's write did not end",
                      request_key=key)  # fmt: skip
            raise RuntimeError("KV handoff could not be fenced; its pages are retired") from None
        finally:
            async with self._region_freed:
                self._region_freed.notify()

    async def _ask_prefill(
        self, req: GenerateRequest, pages: list[int], held: int, region: RegionDescriptor
    ) -> PrefillResult:
        core = self.core
        kv = core.engine_core.kv_cache
        prefill = PrefillRequest(
            request_id=req.request_id,
            token_ids=req.token_ids,
            sampling=req.sampling,
            stream_subject=req.stream_subject,
            decode_worker=core.config.service_id,
            kv_region=region.to_dict(),
            page_indices=pages,
            skip_pages=held,
            model_id=core.model_id,
            page_size=core.config.page_size,
            kv_dtype=core.kv_dtype,
            kv_num_pages=kv.num_pages,
            timeout=req.timeout,
            router=req.router,
        )
        subject = core.subject("prefill", req.prefill_worker, "prefill")
        call = asyncio.ensure_future(
            core.bus.request(subject, prefill, PrefillResult, timeout=core.config.handoff_timeout)
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
        worker, peer_timeout = req.prefill_worker, self.core.config.peer_timeout
        since = time.monotonic()
        next_probe, gone = since + peer_timeout, 0
        while True:
            await asyncio.sleep(min(0.5, peer_timeout / 2))
            now = time.monotonic()
            last = self._prefill_seen.get(worker, since)  # never seen: count from now
            if now - last > peer_timeout:
                return f"stopped reporting (silent for {peer_timeout:g}s)"
            if now >= next_probe:
                next_probe = now + peer_timeout
                gone = gone + 1 if not await self._prefill_active(worker, req) else 0
                if gone >= 2:
                    return "no longer has the request and its reply never came (lost)"

    async def _prefill_active(self, worker: str, req: GenerateRequest) -> bool:
        """Whether `worker` says `req` is in flight there; True when it cannot tell."""
        subject = self.core.subject("prefill", worker, "status")
        try:
            ask = RequestStatus(request_id=req.request_id, router=req.router)
            reply = await self.core.bus.request(
                subject, ask, RequestStatusReply, timeout=self.core.config.peer_timeout
            )
        except BusError:  # an older worker, or a slow one: the load reports decide
            return True
        return reply.active


async def verify_kv(
    core: WorkerCore, req: GenerateRequest, pages: list[int], result: PrefillResult
) -> None:
    """Raise HandoffForged unless `result.kv_mac` vouches for the KV in `pages`.

    Called once the handoff's region is revoked (no byte lands any more). With a KV secret,
    the request decodes only when the MAC matches the request, its prompt, its pages and
    the bytes now in them. Without one (dev mode, logged once at start) nothing is checked.
    """
    if core.kv_mac is None:
        return
    if not result.kv_mac:
        raise HandoffForged(
            f"unverified KV handoff: prefill worker {req.prefill_worker} sent no MAC "
            "(is it started without --kv-secret-file?)"
        )
    key, me = core.kv_mac.handoff_key, core.config.service_id
    seed = handoff_seed(key, req.router, req.request_id, me)
    digest = await asyncio.to_thread(pool_digest, core.engine_core.kv_cache, pages, seed)
    claim = HandoffClaim(req.router, req.request_id, me, req.token_ids, pages,
                         result.first_token, digest)  # fmt: skip
    if not verify_handoff(key, claim, result.kv_mac):
        log.error("KV handoff failed verification: not decoded",
                  prefill_worker=req.prefill_worker, pages=len(pages))  # fmt: skip
        raise HandoffForged(
            f"KV handoff from {req.prefill_worker} failed verification: the bytes in the "
            "reserved pages are not the ones it wrote"
        )
