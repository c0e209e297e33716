"""The prefill side of a KV handoff: pair, write the pages while computing, vouch.

`check_pairing` refuses a decode worker with another model id, page size or KV dtype (its
pages would not hold this worker's KV). `KvSender` writes a prompt's KV into the decode
worker's reserved pages, overlapped with compute: the engine reports, after each prefill
chunk, the pages whose KV is final; `send` starts writing those at once, while the next
chunk computes. `finish` (with the final page table) sends what is left and anything whose
local page changed since it was sent (a page swapped for its cached twin, or a preempted
and recomputed sequence), then waits for every write. A batch of writes lands completely
or fails as a whole (transfer engine contract). `vouch` MACs what was written, for the
decode worker's check (receiver.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from libs.common import tracing
from libs.common.bus.connection import HandlerError
from libs.common.messages.control import PrefillRequest
from libs.common.transfer import RegionDescriptor, TransferEngine
from libs.common.worker.core import WorkerCore
from libs.common.worker.handoff.protocol import (
    HandoffClaim,
    KvLayout,
    handoff_mac,
    handoff_seed,
    page_copy_ops,
    pool_digest,
)


def check_pairing(core: WorkerCore, req: PrefillRequest) -> None:
    """HandlerError 409 unless the decode worker's pool holds KV as this worker's does."""
    mine = (core.model_id, core.config.page_size, core.kv_dtype)
    theirs = (req.model_id, req.page_size, req.kv_dtype)
    if mine != theirs:
        raise HandlerError(
            409,
            f"cannot pair: decode worker {req.decode_worker} has model/page size/KV dtype "
            f"{theirs}, this prefill worker {core.config.service_id} has {mine}",
        )


class KvSender:
    """Prompt pages `skip..num_pages-1` -> `remote_pages[0..]` of the decode worker."""

    def __init__(
        self,
        transfer: TransferEngine,
        local_region: RegionDescriptor,
        local: KvLayout,
        remote_region: RegionDescriptor,
        remote: KvLayout,
        *,
        num_prompt_pages: int,
        skip: int,
        remote_pages: list[int],
    ):
        if skip < 0 or len(remote_pages) != num_prompt_pages - skip:
            raise ValueError(
                f"prompt has {num_prompt_pages} pages, {skip} held by the decode worker, "
                f"but {len(remote_pages)} were reserved for the rest"
            )
        self.transfer, self.local_region, self.remote_region = transfer, local_region, remote_region
        self.local, self.remote = local, remote
        self.num_pages, self.skip, self.remote_pages = num_prompt_pages, skip, remote_pages
        self.sent: dict[int, int] = {}  # prompt page index -> local page it was sent from
        self.request_id = ""  # names the transfers in the request's trace
        self._writes: list[asyncio.Task] = []

    def send(self, page_table: list[int]) -> None:
        """Start writing the pages of `page_table` (final ones) not sent yet as they are."""
        todo = [
            i
            for i in range(self.skip, min(len(page_table), self.num_pages))
            if self.sent.get(i) != page_table[i]
        ]
        if not todo:
            return
        local_pages = [page_table[i] for i in todo]
        remote_pages = [self.remote_pages[i - self.skip] for i in todo]
        ops = page_copy_ops(self.local, local_pages, self.remote, remote_pages)
        # A page sent again (swapped for its cached twin) must land after its first write:
        # two writes in flight at once may land in any order, so this one waits for them.
        earlier = list(self._writes) if any(i in self.sent for i in todo) else []
        self.sent.update(zip(todo, local_pages, strict=True))
        self._writes.append(asyncio.ensure_future(self._write(earlier, ops)))

    async def _write(self, earlier: list[asyncio.Task], ops) -> None:
        for write in earlier:
            await write
        transport, size = self.transfer.transport, sum(op[2] for op in ops)
        with tracing.span("kv.transfer", self.request_id, transport=transport, bytes=size,
                          ops=len(ops)):  # fmt: skip
            await self.transfer.write(self.local_region, self.remote_region, ops)

    async def finish(self, page_table: list[int]) -> None:
        """Send the rest from the final page table and wait for every write to land."""
        if len(page_table) < self.num_pages:
            raise ValueError(f"final page table has {len(page_table)} of {self.num_pages} pages")
        self.send(page_table)
        try:
            for write in self._writes:
                await write
        finally:
            self.cancel()

    def cancel(self) -> None:
        for write in self._writes:
            write.cancel()

    @classmethod
    def for_request(
        cls, core: WorkerCore, req: PrefillRequest, remote: RegionDescriptor
    ) -> KvSender:
        """The sender of `req`'s prompt pages from `core`'s pool into `remote`;
        ValueError when the request's pages do not add up."""
        kv = core.engine_core.kv_cache
        sender = cls(
            core.transfer, core.kv_region,
            KvLayout(kv.num_layers, kv.num_pages, kv.slice_nbytes),
            remote, KvLayout(kv.num_layers, req.kv_num_pages, kv.slice_nbytes),
            num_prompt_pages=-(-len(req.token_ids) // core.config.page_size),
            skip=req.skip_pages, remote_pages=req.page_indices,
        )  # fmt: skip
        sender.request_id = req.request_id
        return sender


async def vouch(
    core: WorkerCore, req: PrefillRequest, first: int, local_pages: Sequence[int]
) -> str:
    """The MAC of what this worker wrote into the decode worker's pages (its own copy of
    the same bytes, `local_pages`, still held by the request): "" without a KV secret."""
    if core.kv_mac is None:
        return ""
    kv, key = core.engine_core.kv_cache, core.kv_mac.handoff_key
    seed = handoff_seed(key, req.router, req.request_id, req.decode_worker)
    digest = await asyncio.to_thread(pool_digest, kv, local_pages, seed)
    claim = HandoffClaim(req.router, req.request_id, req.decode_worker, req.token_ids,
                         req.page_indices, first, digest)  # fmt: skip
    return handoff_mac(key, claim)
