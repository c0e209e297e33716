"""The planner's decision function alone (services/planner/policy.py): no I/O, no clock."""

from __future__ import annotations

import pytest

from libs.common.messages.control import LoadReport
from services.planner.policy import (
    ArrivalPeak,
    Capacity,
    Hysteresis,
    Planner,
    RoleLoad,
    Targets,
    decode_flow_needed,
    decode_needed,
    late_share_of,
    loads_by_role,
    prefill_needed,
)

CAP = Capacity(prefill_tokens_per_s=1000.0, decode_step_base_s=0.01,
               decode_step_per_seq_s=0.002, decode_seats=64)  # fmt: skip
TARGETS = Targets(ttft_s=2.0, itl_s=0.1, min_workers={"prefill": 1, "decode": 1},
                  max_workers={"prefill": 8, "decode": 8}, mean_prompt_tokens=200.0,
                  mean_output_tokens=10.0, startup_s=10.0)  # fmt: skip


def report(role: str, worker: str, **fields) -> LoadReport:
    base = dict(model_id="m", page_size=16, kv_dtype="fp32", waiting=0, running=0,
                waiting_prefill_tokens=0, free_pages=100, total_pages=100, tokens_per_s=0.0,
                max_model_len=2048, timestamp=0.0, max_running=64)  # fmt: skip
    return LoadReport(worker=worker, role=role, **{**base, **fields})


def test_idle_cluster_needs_the_minimum():
    assert prefill_needed(RoleLoad(workers=3), CAP, TARGETS) == 1
    assert decode_needed(RoleLoad(workers=3, total_pages=300), CAP, TARGETS) == 1


def test_prefill_keeps_up_with_arriving_prompt_tokens():
    # 2,400 tokens/s at 1,000 tokens/s a worker and 60% utilization: 4 workers.
    load = RoleLoad(workers=1, prompt_tokens_per_s=2400.0)
    assert prefill_needed(load, CAP, TARGETS) == 4


def test_late_share_is_erlang_c():
    # Two servers at offered load 1: a third of arrivals wait (Erlang C); none past a wait
    # that never ends; every one when the load is the servers' whole capacity.
    assert late_share_of(2, 1.0, 0.0) == pytest.approx(1 / 3)
    assert late_share_of(2, 1.0, 1.0) == pytest.approx(1 / 3 * 2.718281828**-1)
    assert late_share_of(2, 2.0, 0.0) == 1.0 and late_share_of(3, 0.0, 0.0) == 0.0


def test_at_low_load_prefill_runs_enough_workers_that_few_prompts_wait():
    # 1,000-token prompts: 1 s each, 0.4 s of the SLO left for waiting. 500 tokens/s is half
    # a worker (60% utilization: 1 worker), but a prompt then waits whenever another runs:
    # 41% wait past 0.4 s at one worker, 5.5% at two, 0.6% at three.
    t = Targets(ttft_s=2.0, itl_s=0.1, mean_prompt_tokens=1000.0,
                max_workers={"prefill": 8, "decode": 8})  # fmt: skip
    assert prefill_needed(RoleLoad(workers=1, prompt_tokens_per_s=500.0), CAP, t) == 3
    assert prefill_needed(RoleLoad(workers=1), CAP, t) == 1
    # Nothing arriving asks for no worker at all where the minimum is 0.
    idle = Targets(ttft_s=2.0, itl_s=0.1, min_workers={"prefill": 0, "decode": 1})
    assert prefill_needed(RoleLoad(), CAP, idle) == 0


def test_a_measured_queue_time_past_the_budget_adds_a_worker_before_any_ttft_is_seen():
    # Nothing arrives now and the backlog is small, but the oldest request has waited
    # 1.5 s: past the 2 s x 0.7 - 0.2 s = 1.2 s the SLO leaves for queueing.
    load = RoleLoad(workers=2, waiting=3, waiting_prefill_tokens=500, queue_time_s=1.5)
    assert prefill_needed(load, CAP, TARGETS) == 3
    assert prefill_needed(RoleLoad(workers=2, waiting=3, waiting_prefill_tokens=500), CAP,
                          TARGETS) == 1  # fmt: skip


def test_a_backlog_longer_than_a_worker_start_sizes_prefill():
    # 45,000 tokens queued: a worker ready in 10 s still finds them; 45,000 / (1,000 x 11.2).
    load = RoleLoad(workers=1, waiting=90, waiting_prefill_tokens=45_000)
    assert prefill_needed(load, CAP, TARGETS) == 5


def test_decode_batch_is_bounded_by_the_itl_slo():
    # ITL 100 ms: (0.1 - 0.01) / 0.002 = 45 sequences a worker.
    assert CAP.batch_within(0.1) == 45 and CAP.batch_within(0.05) == 20
    load = RoleLoad(workers=1, running=50, waiting=0, total_pages=100)
    assert decode_needed(load, CAP, TARGETS) == 2
    # Prompts now on prefill workers count: they reach decode before a new worker starts.
    assert decode_needed(load, CAP, TARGETS, incoming=41) == 3


def test_decode_is_ready_for_what_the_prefill_workers_can_hand_over():
    # 200-token prompts at 1,000 tokens/s: 5 requests/s a prefill worker, 100 steps each.
    # d workers hold the ITL while 5 x P x 100 x 0.002 / (1 - 0.01 / 0.1) <= d.
    t = Targets(ttft_s=2.0, itl_s=0.1, mean_prompt_tokens=200.0, mean_output_tokens=100.0,
                max_workers={"prefill": 8, "decode": 8})  # fmt: skip
    assert decode_flow_needed(1, CAP, t) == 2  # 1.11
    assert decode_flow_needed(4, CAP, t) == 5  # 4.44
    # Nothing in decode yet, 4 prefill workers: a burst would reach decode within seconds.
    assert decode_needed(RoleLoad(workers=1), CAP, t, prefill_workers=4) == 5
    slow = Capacity(1000.0, decode_step_base_s=0.2, decode_step_per_seq_s=0.0, decode_seats=8)
    assert decode_flow_needed(1, slow, t) == 8  # a step alone passes the SLO: the most


def test_the_flow_count_is_capped_by_the_arrivals_peak_once_known():
    t = Targets(ttft_s=2.0, itl_s=0.1, mean_prompt_tokens=200.0, mean_output_tokens=100.0,
                max_workers={"prefill": 8, "decode": 8})  # fmt: skip
    # 4 prefill workers flat out would hand over 20 requests/s (5 decode workers); the
    # arrivals never passed 1,000 tokens/s (5 requests/s): 2 are enough for those.
    assert decode_flow_needed(4, CAP, t, peak_tokens_per_s=1000.0) == 2
    assert decode_needed(RoleLoad(workers=1), CAP, t, prefill_workers=4,
                         peak_tokens_per_s=1000.0) == 2  # fmt: skip
    # a peak above what prefill can compute changes nothing: prefill is the bound
    assert decode_flow_needed(4, CAP, t, peak_tokens_per_s=1e6) == 5
    assert decode_flow_needed(4, CAP, t, peak_tokens_per_s=None) == 5


def test_arrival_peak_is_unknown_until_the_window_is_seen_then_the_highest_mean():
    arrivals = ArrivalPeak(window_s=60.0, over_s=10.0)
    for at in range(0, 60, 2):  # 30 s at 100 tokens/s, then 10 s at 1,000, then 100 again
        arrivals.add(float(at), 1000.0 if 30 <= at < 40 else 100.0)
        assert arrivals.peak(float(at)) is None  # 0-58 s: not a whole window yet
    arrivals.add(60.0, 100.0)
    # the highest mean over 10 s: the samples 30-38 and 40 (2 s apart, 10 s inclusive)
    assert arrivals.peak(60.0) == pytest.approx((5 * 1000.0 + 100.0) / 6)
    # the burst leaves the window 60 s after it: the peak falls back to the quiet rate
    for at in range(62, 112, 2):
        arrivals.add(float(at), 100.0)
    assert arrivals.peak(110.0) == pytest.approx(100.0)
    assert ArrivalPeak(window_s=0.0, over_s=10.0).peak(1e6) is None  # 0: never learned


def test_planner_sizes_decode_for_the_bursts_it_has_seen():
    t = Targets(ttft_s=2.0, itl_s=0.1, mean_prompt_tokens=200.0, mean_output_tokens=100.0,
                max_workers={"prefill": 8, "decode": 8}, flow_window_s=20.0)  # fmt: skip
    plan = Planner(CAP, t, Hysteresis(0.0))
    current = {"prefill": 4, "decode": 5}
    reports = [report("prefill", f"p{i}", prompt_tokens_per_s=250.0) for i in range(4)]
    first = plan.decide([*reports, report("decode", "d1")], current, 0.0)
    assert first.peak_tokens_per_s is None and first.needed["decode"] == 5  # flat out
    for at in range(2, 22, 2):
        out = plan.decide([*reports, report("decode", "d1")], current, float(at))
    assert out.peak_tokens_per_s == pytest.approx(1000.0)
    assert out.needed["decode"] == 2
    # A decode worker saw its ITL p90 past the SLO: the capacity model under-sized decode,
    # and the peak (which rests on it) caps nothing from then on.
    slow = report("decode", "d1", itl_p90_s=0.15)
    out = plan.decide([*reports, slow], current, 22.0)
    assert plan.decode_model_wrong_at == 22.0
    assert out.peak_tokens_per_s is None and out.needed["decode"] == 5
    out = plan.decide([*reports, report("decode", "d1")], current, 200.0)
    assert out.peak_tokens_per_s is None and out.needed["decode"] == 5


def test_observed_latency_past_the_slo_adds_a_worker_to_those_reporting():
    # No arrivals, one prompt queued briefly: the capacity model alone asks for the minimum,
    # but the workers saw TTFT p90 2.5 s (SLO 2 s) and ITL p90 150 ms (SLO 100 ms).
    late = RoleLoad(workers=2, running=2, waiting=1, ttft_p90_s=2.5)
    assert prefill_needed(late, CAP, TARGETS) == 3
    assert prefill_needed(RoleLoad(workers=2, waiting=1, ttft_p90_s=1.9), CAP, TARGETS) == 1
    # late with nothing waiting: prompts whose own prefill passes the SLO, which no added
    # worker would help
    assert prefill_needed(RoleLoad(workers=2, running=2, ttft_p90_s=2.5), CAP, TARGETS) == 1
    slow = RoleLoad(workers=3, total_pages=300, itl_p90_s=0.15)
    assert decode_needed(slow, CAP, TARGETS) == 4
    assert decode_needed(RoleLoad(workers=3, total_pages=300, itl_p90_s=0.09), CAP, TARGETS) == 1
    # the worst worker's p90 is the role's
    loads = loads_by_role([report("decode", "d1", itl_p90_s=0.02),
                           report("decode", "d2", itl_p90_s=0.2),
                           report("prefill", "p1", ttft_p90_s=0.4)])  # fmt: skip
    assert loads["decode"].itl_p90_s == 0.2
    assert loads["prefill"].ttft_p90_s == 0.4


def test_decode_counts_the_prompts_prefill_computes_now_not_those_still_queued():
    # 45 sequences a worker (above). 43 in decode + 2 prompts computing: 1 worker. The 40
    # queued behind them reach decode one prompt time apart, while these finish.
    plan = Planner(CAP, TARGETS, Hysteresis(30.0))
    reports = [
        report("prefill", "p1", running=1, waiting=20),
        report("prefill", "p2", running=1, waiting=20),
        report("decode", "d1", running=43),
    ]
    out = plan.decide(reports, {"prefill": 2, "decode": 1}, 0.0)
    assert out.needed["decode"] == 1
    assert out.loads["prefill"].waiting == 40


def test_decode_needs_pages_for_what_it_holds():
    load = RoleLoad(workers=2, running=4, used_pages=190, total_pages=200)
    assert decode_needed(load, CAP, TARGETS) == 3  # 190 / (100 x 0.9)


def test_counts_stay_within_the_bounds():
    load = RoleLoad(workers=8, prompt_tokens_per_s=1e9, queue_time_s=100.0)
    assert prefill_needed(load, CAP, TARGETS) == 8


def test_reports_of_role_both_count_as_decode():
    loads = loads_by_role([report("both", "w1", running=3), report("decode", "w2", running=2),
                           report("prefill", "p1", queue_time_s=0.5),
                           report("prefill", "p2", queue_time_s=1.5)])  # fmt: skip
    assert loads["decode"].workers == 2 and loads["decode"].running == 5
    assert loads["prefill"].queue_time_s == 1.5


def test_hysteresis_scales_up_at_once_and_down_one_at_a_time_after_the_wait():
    h = Hysteresis(scale_down_after_s=30.0)
    now = {"prefill": 2, "decode": 2}
    assert h.decide(now, {"prefill": 5, "decode": 2}, 0.0) == {"prefill": 5, "decode": 2}
    current = {"prefill": 5, "decode": 2}
    assert h.decide(current, {"prefill": 1, "decode": 2}, 1.0)["prefill"] == 5
    assert h.decide(current, {"prefill": 1, "decode": 2}, 20.0)["prefill"] == 5
    assert h.decide(current, {"prefill": 1, "decode": 2}, 31.0)["prefill"] == 4
    # A need as high as now in between restarts the wait.
    h2 = Hysteresis(scale_down_after_s=30.0)
    h2.decide(current, {"prefill": 1, "decode": 2}, 0.0)
    h2.decide(current, {"prefill": 5, "decode": 2}, 20.0)
    assert h2.decide(current, {"prefill": 1, "decode": 2}, 40.0)["prefill"] == 5


def test_planner_decides_from_reports():
    plan = Planner(CAP, TARGETS, Hysteresis(30.0))
    reports = [report("prefill", "p1", prompt_tokens_per_s=2400.0), report("decode", "d1")]
    out = plan.decide(reports, {"prefill": 1, "decode": 1}, 0.0)
    assert out.counts == {"prefill": 4, "decode": 1}
    assert out.loads["prefill"].prompt_tokens_per_s == 2400.0


@pytest.mark.parametrize("bad", [dict(prefill_tokens_per_s=0.0), dict(decode_seats=0),
                                 dict(decode_step_base_s=0.0)])  # fmt: skip
def test_capacity_refuses_impossible_values(bad):
    fields = dict(prefill_tokens_per_s=1.0, decode_step_base_s=0.01, decode_step_per_seq_s=0.0,
                  decode_seats=1)  # fmt: skip
    with pytest.raises(ValueError):
        Capacity(**{**fields, **bad})


def test_old_workers_load_reports_still_parse():
    """A worker from before the planner's fields sends none: they decode as 0."""
    old = report("decode", "d1").encode()
    import orjson

    body = orjson.loads(old)
    del body["queue_time_s"], body["prompt_tokens_per_s"]
    decoded = LoadReport.decode(orjson.dumps(body))
    assert decoded.queue_time_s == 0.0 and decoded.prompt_tokens_per_s == 0.0
