"""Observed latency in load reports: real workers measure TTFT and the time between tokens."""

from __future__ import annotations

import time

from libs.common.worker.latency import LatencyWindow
from tests.workers.conftest import generate, next_load_reports, prompt_ids


async def test_workers_report_the_ttft_and_token_spacing_they_observed(bus):
    started = time.monotonic()
    split = await generate(bus, "lat-pd", prompt_ids(40, seed=7), decode="d1", prefill="p1",
                           max_tokens=12)  # fmt: skip
    alone = await generate(bus, "lat-both", prompt_ids(40, seed=8), decode="d2", max_tokens=12)
    took = time.monotonic() - started
    assert len(split.token_ids) == len(alone.token_ids) == 12
    reports = await next_load_reports(bus, {"p1", "d1", "d2"})
    # the prefill worker: a prompt's arrival to its first token; the decode worker that
    # received the KV: the spacing of tokens 1..11; the `both` worker: both
    assert 0 < reports["p1"].ttft_p90_s <= took * 1.05
    assert 0 < reports["d1"].itl_p90_s <= took * 1.05
    assert 0 < reports["d2"].ttft_p90_s <= took * 1.05
    assert 0 < reports["d2"].itl_p90_s < reports["d2"].ttft_p90_s * 12
    assert reports["p1"].itl_p90_s == 0.0  # a prefill worker streams no spacing of its own


def test_a_latency_window_gives_quantiles_within_its_bucket_width_and_forgets():
    w = LatencyWindow(window_s=10.0)
    assert w.quantile(0.9, now=100.0) == 0.0  # empty
    for i in range(1, 101):  # 10 ms .. 1 s
        w.add(i / 100, now=100.0)
    p90 = w.quantile(0.9, now=100.5)
    assert 0.90 <= p90 <= 0.90 * 1.05
    assert 0.50 <= w.quantile(0.5, now=100.5) <= 0.50 * 1.05
    w.add(5.0, weight=900, now=105.0)  # weighted: 900 more samples of 5 s
    assert 5.0 <= w.quantile(0.9, now=105.0) <= 5.0 * 1.05
    assert w.quantile(0.9, now=110.5) > 4.0  # the 100 s second is gone, 105 s is not
    assert w.quantile(0.05, now=110.5) > 4.0
    assert w.quantile(0.9, now=115.5) == 0.0  # all forgotten
    w.add(-0.001, now=120.0)  # clock noise counts as the smallest bucket
    assert w.quantile(1.0, now=120.0) <= 1e-4
