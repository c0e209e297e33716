"""PromptBacklog: the decode worker's estimate of how long a new prompt waits for prefill."""

from __future__ import annotations

import math

from libs.common.worker.backlog import PromptBacklog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_wait_is_queued_tokens_over_the_drain_rate_of_the_last_window():
    clock = Clock()
    b = PromptBacklog(window_s=10, clock=clock)
    b.add(1000)
    assert b.expected_wait(100) == 0.0  # no history yet: admit
    for _ in range(10):  # 100 tokens drained per second
        clock.now += 1
        b.done(100)
        b.add(100)
    assert b.rate() == 100.0
    assert b.expected_wait(200) == (1000 + 200) / 100


def test_an_empty_queue_admits_and_a_stuck_one_refuses():
    clock = Clock()
    b = PromptBacklog(window_s=10, clock=clock)
    b.add(50)
    b.done(50)
    clock.now = 100
    assert b.expected_wait(10_000) == 0.0  # idle: nothing waits
    b.add(50)
    clock.now = 111  # a whole window without any prompt done
    assert math.isinf(b.expected_wait(1))
