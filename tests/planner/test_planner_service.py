"""The planner as a real process on a real nats-server, fed load reports over NATS."""

from __future__ import annotations

import subprocess
import sys

from scripts.cluster import REPO
from tests.planner.conftest import Feeder, planner_details, report, wait_for


async def test_a_measured_prefill_queue_scales_prefill_up_and_idle_scales_it_back(
    planner_cluster, tmp_path
):
    _cluster, nc, start = planner_cluster
    await start("planner-t", "--max-prefill", "3")
    feeder = Feeder(nc)
    # Nothing arrives and little is queued, but the oldest prompt has waited 5 s: past
    # what a 2 s TTFT leaves for queueing. No request has finished (no TTFT observed).
    feeder.reports = [report("prefill", "prefill-1", waiting=2, waiting_prefill_tokens=200,
                             queue_time_s=5.0), report("decode", "decode-1")]  # fmt: skip
    feeder.start()
    try:

        async def prefill_count(at_least: int = 0, at_most: int = 99):
            n = (await planner_details(nc, "planner-t"))["prefill_workers"]
            return n if at_least <= n <= at_most else 0

        assert await wait_for(lambda: prefill_count(at_least=2), 30, "prefill scaled up") >= 2
        feeder.reports = [report("prefill", "prefill-1"), report("decode", "decode-1")]
        assert await wait_for(lambda: prefill_count(at_most=1), 30, "back to 1") == 1
    finally:
        await feeder.stop()
    log = (tmp_path / "logs" / "planner-t.log").read_text()
    assert "planner decision" in log and "planner would scale" in log


async def test_a_bad_load_report_is_logged_and_the_planner_keeps_deciding(
    planner_cluster, tmp_path
):
    cluster, nc, start = planner_cluster
    await start("planner-b")
    await nc.publish("tandem.workers.decode.x.load", b'{"type": "load", "v": 1, "worker": 3}')
    await nc.publish("tandem.workers.decode.x.load", b"\x80not json")
    feeder = Feeder(nc)
    feeder.reports = [report("decode", "decode-1")]
    feeder.start()
    try:

        async def decided():
            return (await planner_details(nc, "planner-b"))["decisions"] >= 2

        assert await wait_for(decided, 30, "decisions after bad reports")
    finally:
        await feeder.stop()
    assert cluster.procs["planner-b"].poll() is None
    assert "bad load report" in (tmp_path / "logs" / "planner-b.log").read_text()


def test_bad_flags_are_refused_naming_the_flag(service_env):
    for flags, named in ((["--min-decode", "3", "--max-decode", "2"], "--min-decode"),
                         (["--itl-p90-ms", "0"], "--itl-p90-ms"),
                         (["--actuator", "cloud"], "--actuator")):  # fmt: skip
        cmd = [sys.executable, "-m", "services.planner", *flags]
        proc = subprocess.run(cmd, cwd=REPO, env=service_env, capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert proc.returncode == 2 and named in proc.stderr


async def test_observed_itl_past_the_slo_scales_decode_up_though_nothing_is_queued(
    planner_cluster,
):
    _cluster, nc, start = planner_cluster
    await start("planner-s", "--max-decode", "3", "--itl-p90-ms", "100")
    feeder = Feeder(nc)
    # Two sequences and no queue: the capacity model says one decode worker is plenty, but
    # the worker measured 250 ms between tokens (a slower host than the capacity flags).
    feeder.reports = [report("prefill", "prefill-1"),
                      report("decode", "decode-1", running=2, itl_p90_s=0.25)]  # fmt: skip
    feeder.start()
    try:

        async def decode_count(at_least: int = 0, at_most: int = 99):
            n = (await planner_details(nc, "planner-s"))["decode_workers"]
            return n if at_least <= n <= at_most else 0

        assert await wait_for(lambda: decode_count(at_least=2), 30, "decode scaled up") == 2
        # the window shows ITL back under the SLO: the arm lets go, and the count comes
        # back down (--scale-down-after 1)
        feeder.reports = [report("prefill", "prefill-1"),
                          report("decode", "decode-1", running=2, itl_p90_s=0.03),
                          report("decode", "decode-2", running=0, itl_p90_s=0.0)]  # fmt: skip
        assert await wait_for(lambda: decode_count(at_most=1), 30, "back to 1") == 1
    finally:
        await feeder.stop()
