"""The local actuator over real processes: the planner starts a real decode worker (the
default model) when a decode queue builds, and stops it, drained, when the load is gone."""

from __future__ import annotations

import asyncio
import json
import time

from libs.common.messages.control import LoadReport
from tests.planner.conftest import Feeder, report, wait_for


async def test_a_decode_queue_starts_a_decode_worker_and_idle_stops_it(planner_cluster, tmp_path):
    cluster, nc, start = planner_cluster
    cluster.env.update({"TANDEM_DECODE_NO_POOL": "true", "TANDEM_DECODE_NUM_THREADS": "1",
                        "TANDEM_DECODE_KV_CACHE_MB": "64"})  # fmt: skip
    heard: dict[str, float] = {}

    async def on_load(msg):
        r = LoadReport.decode(msg.data)
        heard[r.worker] = time.monotonic()

    await nc.subscribe("tandem.workers.decode.*.load", cb=on_load)
    await start("planner-l", "--actuator", "local", "--max-decode", "2")
    feeder = Feeder(nc)
    # decode-1 (reported by the test) has requests waiting 2 s for a seat: past the ITL SLO.
    queued = report("decode", "decode-1", running=64, waiting=8, queue_time_s=2.0)
    feeder.reports = [report("prefill", "prefill-1"), queued]
    feeder.start()
    try:

        async def started():
            return "decode-p1" in heard

        await wait_for(started, 120, "decode-p1 (a real worker) reporting")
        feeder.reports = [report("prefill", "prefill-1"), report("decode", "decode-1")]
        log_path = tmp_path / "logs" / "planner-l.log"

        async def stopped():  # the planner logs it once the process has exited
            return '"worker stopped"' in log_path.read_text()

        await wait_for(stopped, 90, "decode-p1 stopped by the planner")
        await asyncio.sleep(1.0)
        assert time.monotonic() - heard["decode-p1"] >= 1.0  # it no longer reports
        assert "decode-p2" not in heard  # never more than asked: --max-decode 2 with decode-1
    finally:
        await feeder.stop()
    lines = [json.loads(x) for x in log_path.read_text().splitlines() if x.startswith("{")]
    events = {(e.get("event"), e.get("worker")): e for e in lines}
    assert ("worker started", "decode-p1") in events
    assert events[("worker stopped", "decode-p1")]["code"] == 0  # drained, exited cleanly
