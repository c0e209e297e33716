"""`make run` splits the host's cores between its two model workers."""

from __future__ import annotations

import os

from scripts.cluster import worker_threads


def test_each_model_worker_gets_half_the_cores_at_least_one():
    half = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert worker_threads({}) == {
        "TANDEM_PREFILL_NUM_THREADS": half,
        "TANDEM_DECODE_NUM_THREADS": half,
    }


def test_a_thread_count_in_the_environment_wins():
    got = worker_threads({"TANDEM_PREFILL_NUM_THREADS": "3"})
    assert "TANDEM_PREFILL_NUM_THREADS" not in got and "TANDEM_DECODE_NUM_THREADS" in got
