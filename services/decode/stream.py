"""Publishing a request's tokens on its stream subject, coalesced when the bus falls behind.

The engine hands over one output per step. While a publish is in flight, newer outputs
pile up and leave together in the next TokenChunk, so a slow consumer gets fewer, larger
messages instead of an ever-growing backlog.
"""

from __future__ import annotations

import asyncio

from libs.common.bus import Bus
from libs.common.messages import TokenChunk, Usage


class TokenStream:
    """Chunks for one request, numbered from `next_index`."""

    def __init__(self, bus: Bus, subject: str, request_id: str, worker: str, next_index: int):
        self.bus, self.subject, self.request_id, self.worker = bus, subject, request_id, worker
        self.next_index = next_index
        self._ids: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[dict] = []
        self._lock = asyncio.Lock()

    async def add(self, token_ids: list[int], text: str, logprobs: list[dict]) -> None:
        self._ids += token_ids
        self._text.append(text)
        self._logprobs += logprobs
        if self._lock.locked():
            return  # the publish in flight will pick these up on its next round
        async with self._lock:
            while self._ids:
                await self._send()

    async def finish(
        self, finish_reason: str, usage: Usage | None, error: str | None = None
    ) -> None:
        async with self._lock:
            await self._send(finish_reason=finish_reason, usage=usage, error=error)

    async def _send(self, **final) -> None:
        ids, text, lps = self._ids, "".join(self._text), self._logprobs
        self._ids, self._text, self._logprobs = [], [], []
        chunk = TokenChunk(
            request_id=self.request_id,
            index=self.next_index,
            token_ids=ids,
            worker=self.worker,
            text=text,
            logprobs=lps,
            **final,
        )
        self.next_index += len(ids)
        await self.bus.publish(self.subject, chunk)
