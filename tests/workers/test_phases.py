"""A decode worker's phases in the request's trace (libs/common/worker/phases.py): the
queue ends where the first step begins, on both paths, and never covers that step."""

from __future__ import annotations

import time

from libs.common import tracing
from libs.common.engine.core.outputs import RequestOutput
from libs.common.worker.phases import DecodeSpans

STEP_S = 0.05  # a first step's length, in real time
WAIT_S = 0.01  # the request's wait for a batch slot, as the engine reports it
WAIT_NS = int(WAIT_S * 1e9)


def _phases(exported) -> dict[str, tuple[int, int]]:
    spans = {s.name: s for s in exported.get_finished_spans()}
    return {n: (s.start_time, s.end_time) for n, s in spans.items() if n != "decode.request"}


def _output(token: int, queue_time: float | None, finished: bool = False) -> RequestOutput:
    return RequestOutput("r1", [token], "", finished, queue_time=queue_time)


def test_a_handed_over_request_queues_until_its_first_step_and_not_through_it(exported):
    """Token 0 (from the prefill worker) is out before any step here; the queue ends
    `queue_time` after it, read from the first step's output, where decode.tokens begins."""
    with tracing.span("decode.request", "r1", context=tracing.joined(None)):
        spans = DecodeSpans("r1", prefilled_here=False)
        before = tracing.now()
        spans.output(_output(5, None))  # token 0: the request joins the queue
        joined = tracing.now()
        time.sleep(STEP_S)  # its wait, then its first step
        stepped = tracing.now()
        spans.output(_output(6, WAIT_S))
        spans.output(_output(7, WAIT_S, finished=True))
        spans.finished(3)
    phases = _phases(exported)
    assert set(phases) == {"decode.queue", "decode.tokens"}
    (queue_start, queue_end), (tokens_start, tokens_end) = (phases["decode.queue"],
                                                            phases["decode.tokens"])  # fmt: skip
    assert queue_start <= before
    assert before + WAIT_NS <= queue_end <= joined + WAIT_NS  # the wait, all of it
    assert queue_end < stepped  # ... and not the step
    assert tokens_start == queue_end and tokens_end >= stepped


def test_a_prompt_prefilled_here_queues_then_prefills_then_decodes(exported):
    with tracing.span("decode.request", "r1", context=tracing.joined(None)):
        spans = DecodeSpans("r1", prefilled_here=True)
        time.sleep(STEP_S)
        spans.output(_output(5, WAIT_S))
        spans.output(_output(6, WAIT_S, finished=True))
        spans.finished(2)
    phases = _phases(exported)
    assert set(phases) == {"decode.queue", "decode.prefill", "decode.tokens"}
    queue, prefill, tokens = (phases[f"decode.{n}"] for n in ("queue", "prefill", "tokens"))
    assert queue[1] - queue[0] == WAIT_NS
    assert queue[1] == prefill[0] and prefill[1] == tokens[0]
    assert prefill[1] - prefill[0] >= (STEP_S - WAIT_S) * 1e9
