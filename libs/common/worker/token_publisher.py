"""Publishing a request's tokens to the router: one TokenChunk per publish, or batched.

The engine hands over one output per step. With a `batch_subject` (the router asked for
it), the chunk goes to the worker's `ChunkBatcher`, which sends the chunks of every request
of one step for one router as one TokenChunkBatch: an engine step wakes all its requests'
tasks in the same event-loop turn, and the batcher publishes in the turn after.
Without one, while a publish is in flight newer outputs pile up and leave together in the
next TokenChunk, so a slow consumer gets fewer, larger messages instead of a backlog.
"""

from __future__ import annotations

import asyncio

from libs.common.bus.connection import Bus
from libs.common.log import get_logger
from libs.common.messages.control import TokenChunk, Usage, encode_chunk_batch

log = get_logger(__name__)

_ENVELOPE = 256  # bytes of a batch's own fields, on top of its chunks and their commas


class ChunkBatcher:
    """Chunks added in one loop turn leave as one TokenChunkBatch per subject, in order.

    A batch stays under the connection's max payload (split otherwise; a single chunk over
    it still goes alone, and the publish error is logged as it would be for a TokenChunk).
    """

    def __init__(self, bus: Bus, worker: str):
        self.bus, self.worker = bus, worker
        self._pending: dict[str, list[bytes]] = {}
        self._flush: asyncio.Task | None = None

    def add(self, subject: str, chunk: TokenChunk) -> None:
        self._pending.setdefault(subject, []).append(chunk.encode())
        if self._flush is None:
            # A task starts on the next loop turn, after every request this step woke.
            self._flush = self.bus.spawn(self._send(), name="chunk-batch")

    async def _send(self) -> None:
        pending, self._pending, self._flush = self._pending, {}, None
        limit = self.bus.nc.max_payload - _ENVELOPE
        for subject, chunks in pending.items():
            for group in _groups(chunks, limit):
                try:
                    await self.bus.nc.publish(subject, encode_chunk_batch(self.worker, group))
                except Exception as e:  # the router notices the hole and ends the stream
                    log.warning("token chunk batch not sent", subject=subject, error=str(e))


def _groups(chunks: list[bytes], limit: int) -> list[list[bytes]]:
    groups: list[list[bytes]] = [[]]
    size = 0
    for c in chunks:
        if groups[-1] and size + len(c) + 1 > limit:
            groups.append([])
            size = 0
        groups[-1].append(c)
        size += len(c) + 1
    return groups


class TokenStream:
    """Chunks for one request, numbered from `next_index`."""

    def __init__(
        self,
        bus: Bus,
        subject: str,
        request_id: str,
        worker: str,
        next_index: int,
        *,
        batcher: ChunkBatcher | None = None,
        batch_subject: str = "",
    ):
        self.bus, self.subject, self.request_id, self.worker = bus, subject, request_id, worker
        self.next_index = next_index
        self.batcher = batcher if batch_subject else None
        self.batch_subject = batch_subject
        self._ids: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[dict] = []
        self._prompt_logprobs: list[dict] = []
        self._lock = asyncio.Lock()

    async def add(
        self, token_ids: list[int], text: str, logprobs: list[dict], prompt_logprobs=()
    ) -> None:
        """Queue tokens; `prompt_logprobs` go with the request's first tokens only."""
        self._ids += token_ids
        self._text.append(text)
        self._logprobs += logprobs
        self._prompt_logprobs += prompt_logprobs
        if self._lock.locked():
            return  # the publish in flight will pick these up on its next round
        async with self._lock:
            while self._ids:
                await self._send()

    async def finish(
        self,
        finish_reason: str,
        usage: Usage | None,
        error: str | None = None,
        stop_reason: str | int | None = None,
    ) -> None:
        async with self._lock:
            await self._send(
                finish_reason=finish_reason, usage=usage, error=error, stop_reason=stop_reason
            )

    async def _send(self, **final) -> None:
        ids, text, lps = self._ids, "".join(self._text), self._logprobs
        self._ids, self._text, self._logprobs = [], [], []
        prompt_lps, self._prompt_logprobs = self._prompt_logprobs, []
        chunk = TokenChunk(
            request_id=self.request_id,
            index=self.next_index,
            token_ids=ids,
            worker=self.worker,
            text=text,
            logprobs=lps,
            prompt_logprobs=prompt_lps,
            **final,
        )
        self.next_index += len(ids)
        if self.batcher is not None:
            self.batcher.add(self.batch_subject, chunk)
        else:
            await self.bus.publish(self.subject, chunk)
