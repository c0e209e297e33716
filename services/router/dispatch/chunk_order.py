"""The order of one stream's TokenChunks: they come from two connections (a prefill
worker's token 0 one by one, a decode worker's steps in batches), so they may arrive out
of order or twice.

    push(chunk) -> the chunks now ready, in `index` order, ending at the final one

Pure Python, synchronous: the router calls it from its NATS callback. `index` is the
position of a chunk's first token in the completion; a chunk moves the order on by its
number of tokens.
"""

from __future__ import annotations

import time

from libs.common.messages.control import TokenChunk

FAILED = ("error", "abort")  # abort: a worker shut down


class ChunkOrder:
    """Reorders and deduplicates one stream; `next_index`, `held` and `moved` (monotonic
    time the order last moved on) are what the lost-chunk check reads."""

    def __init__(self, start: int = 0) -> None:
        self.next_index = start  # a continuation's first index: the tokens sent before it
        self.held: dict[int, TokenChunk] = {}
        self.moved = time.monotonic()
        self.ended = False

    def push(self, chunk: TokenChunk) -> list[TokenChunk]:
        if self.ended:
            return []
        if chunk.index < self.next_index:
            if chunk.finish_reason in FAILED:
                # A worker that failed before it knew what others streamed (the decode
                # worker whose handoff failed after the prefill worker sent token 0)
                # numbers its error from its own view: it still ends the stream.
                self.ended = True
                return [chunk]
            return []  # a duplicate
        if chunk.index == self.next_index and not self.held:  # the usual case: in order
            return self._take(chunk, [])
        self.held[chunk.index] = chunk
        ready: list[TokenChunk] = []
        while self.next_index in self.held and not self.ended:
            before = self.next_index
            self._take(self.held.pop(before), ready)
            if self.next_index == before:
                break  # an empty non-final chunk cannot advance the order
        return ready

    def _take(self, chunk: TokenChunk, ready: list[TokenChunk]) -> list[TokenChunk]:
        ready.append(chunk)
        self.next_index += len(chunk.token_ids)
        self.moved = time.monotonic()
        if chunk.finish_reason is not None:
            self.ended = True
        return ready
