"""A request's engine phases as spans of its trace, recorded once each is over.

    ChunkSpans   a prompt on a prefill worker: `prefill.queue` (add_request to its first
                 step), then one `prefill.chunk` per output
    DecodeSpans  a request on a decode worker: `decode.queue` (to its first step),
                 `decode.prefill` (a prompt prefilled here: that step to its first
                 output), `decode.tokens` (to its last token)

The engine tells when a request's first step began: RequestOutput.queue_time, seconds
after it joined the queue. These turn it into span bounds on the trace's clock
(`tracing.now()`); with tracing off they do nothing.
"""

from __future__ import annotations

from libs.common import tracing
from libs.common.engine.core.outputs import RequestOutput


def _first_step(since: int, out: RequestOutput, now: int) -> int:
    """When the first step began: `queue_time` after `since` (when the request joined the
    queue), at most `now`; `now` when the engine does not say."""
    if out.queue_time is None:
        return now
    return min(since + int(out.queue_time * 1e9), now)


class ChunkSpans:
    """A prompt's steps in its trace: `prefill.queue` (from add_request to its first
    step), then one `prefill.chunk` per output, each from the previous one's end."""

    def __init__(self, request_id: str) -> None:
        self.request_id, self.index, self.since = request_id, 0, tracing.now()

    def done(self, out: RequestOutput) -> None:
        if not tracing.enabled():
            return
        now = tracing.now()
        if self.index == 0 and out.queue_time is not None:
            queued = _first_step(self.since, out, now)
            tracing.record("prefill.queue", self.request_id, self.since, queued)
            self.since = queued
        tracing.record("prefill.chunk", self.request_id, self.since, now, chunk=self.index)
        self.index, self.since = self.index + 1, now


class DecodeSpans:
    """A request's time on a decode worker, from the moment its prompt can run here
    (created then). `decode.queue` ends when it enters the running batch, before its
    first step, on both paths:

    - prefilled here: its first output follows its first step; the queue is the part of
      that wait before the step (queue_time), `decode.prefill` the rest
    - handed over: its first output is token 0, sampled by the prefill worker and out as
      soon as the engine took the request (Engine.decode_imported), before any step here;
      the queue ends `queue_time` after that, read from the output of its first step,
      where `decode.tokens` begins"""

    def __init__(self, request_id: str, *, prefilled_here: bool) -> None:
        self.request_id, self.prefilled_here = request_id, prefilled_here
        self.started = tracing.now()
        self.first_at = 0  # its first output
        self.tokens_from = 0  # where decode.tokens begins, once known

    def output(self, out: RequestOutput) -> None:
        if not tracing.enabled() or self.tokens_from:
            return
        now = tracing.now()
        if not self.first_at:
            self.first_at = now
            if self.prefilled_here:
                stepped = _first_step(self.started, out, now)
                tracing.record("decode.queue", self.request_id, self.started, stepped)
                tracing.record("decode.prefill", self.request_id, stepped, now)
                self.tokens_from = now
            elif out.finished:  # token 0 ended it: no step here
                tracing.record("decode.queue", self.request_id, self.started, now)
                self.tokens_from = now
            return
        stepped = _first_step(self.first_at, out, now)  # handed over: its first step's output
        tracing.record("decode.queue", self.request_id, self.started, stepped)
        self.tokens_from = stepped

    def finished(self, completion_tokens: int) -> None:
        """Its last token is out."""
        if tracing.enabled():
            now = tracing.now()
            tracing.record("decode.tokens", self.request_id, self.tokens_from or now, now,
                           completion_tokens=completion_tokens)  # fmt: skip
