"""The decode worker's check of a prefill worker's KV handoff (worker/handoff/protocol.py).

Called once the handoff's region is unregistered (the fence: no byte lands any more), with
the PrefillResult. With a KV secret, the request decodes only when the result's `kv_mac`
matches the request, its prompt, its pages and the bytes now in them; otherwise it fails
(the caller ends the stream with an error and frees the pages, which never entered the
prefix cache). Without a secret (dev mode, logged once at start) nothing is checked.
"""

from __future__ import annotations

import asyncio
from typing import Any

from libs.common.log import get_logger
from libs.common.messages.control import GenerateRequest, PrefillResult
from libs.common.worker.handoff.protocol import (
    HandoffClaim,
    handoff_seed,
    pool_digest,
    verify_handoff,
)

log = get_logger(__name__)


class HandoffForged(RuntimeError):
    """The KV in the reserved pages is not what the prefill worker vouched for."""


async def verify_kv(
    worker: Any, req: GenerateRequest, pages: list[int], result: PrefillResult
) -> None:
    """Raise HandoffForged unless `result.kv_mac` vouches for the KV in `pages`.

    `worker` is the decode worker (its `kv_mac`, `engine`, `config.service_id`)."""
    if worker.kv_mac is None:
        return
    if not result.kv_mac:
        raise HandoffForged(
            f"unverified KV handoff: prefill worker {req.prefill_worker} sent no MAC "
            "(is it started without --kv-secret-file?)"
        )
    key, me = worker.kv_mac.handoff_key, worker.config.service_id
    seed = handoff_seed(key, req.router, req.request_id, me)
    digest = await asyncio.to_thread(pool_digest, worker.engine.core.kv_cache, pages, seed)
    claim = HandoffClaim(req.router, req.request_id, me, req.token_ids, pages,
                         result.first_token, digest)  # fmt: skip
    if not verify_handoff(key, claim, result.kv_mac):
        log.error("KV handoff failed verification: not decoded",
                  prefill_worker=req.prefill_worker, pages=len(pages))  # fmt: skip
        raise HandoffForged(
            f"KV handoff from {req.prefill_worker} failed verification: the bytes in the "
            "reserved pages are not the ones it wrote"
        )
