"""bench.plan's simulator and report (capacity given as a file: no model is measured)."""

from __future__ import annotations

import json

import pytest

from bench import plan
from bench.plan_model import fit_line
from bench.plan_sim import Cluster, Req, Run, simulate
from services.planner.policy import Capacity, Targets

CAPACITY = {"prefill_tokens_per_s": 500.0, "decode_step_base_s": 0.014,
            "decode_step_per_seq_s": 0.004, "decode_seats": 64}  # fmt: skip


def test_fit_line_recovers_a_line():
    base, slope = fit_line([(1, 0.012), (4, 0.018), (8, 0.026), (16, 0.042)])
    assert base == pytest.approx(0.010) and slope == pytest.approx(0.002)


def test_a_static_cluster_finishes_every_request_and_counts_its_worker_seconds():
    cap = Capacity(**CAPACITY)
    trace = [Req(0.1 * i, prompt=100, output=10) for i in range(50)]
    cluster = Cluster(cap, startup_s=10.0)
    cluster.scale({"prefill": 1, "decode": 2}, 0.0, ready=0.0)
    result = simulate(trace, cluster, lambda *_: {"prefill": 1, "decode": 2}, Run())
    assert all(r.done is not None and r.first_token is not None for r in trace)
    # Prefill alone bounds the first token: 100 tokens at 500/s.
    assert min(r.ttft for r in trace) >= 0.2 - 1e-9
    ws = result["worker_seconds"]
    assert ws["decode"] == pytest.approx(2 * result["end_s"])


def test_a_removed_worker_leaves_once_empty_and_stops_costing():
    cap = Capacity(**CAPACITY)
    cluster = Cluster(cap, startup_s=0.0)
    cluster.scale({"prefill": 2, "decode": 1}, 0.0, ready=0.0)
    cluster.scale({"prefill": 1, "decode": 1}, 1.0)
    cluster.tick(1.0, 0.05)
    assert cluster.worker_seconds(100.0)["prefill"] == pytest.approx(100.0 + 1.0)
    # From a warm-up at 50 s: the one left counts its last 50 s, the one gone at 1 s nothing.
    assert cluster.worker_seconds(100.0, start=50.0)["prefill"] == pytest.approx(50.0)


def test_static_splits_searched_are_every_split_of_the_total_within_the_bounds():
    targets = Targets(2.0, 0.1, min_workers={"prefill": 1, "decode": 2},
                           max_workers={"prefill": 4, "decode": 8})  # fmt: skip
    got = [(s["prefill"], s["decode"]) for s in plan.splits_within(6, targets)]
    assert got == [(1, 5), (2, 4), (3, 3), (4, 2)]


def test_bench_plan_prints_each_policy_per_trace(tmp_path, capsys):
    cache = tmp_path / "capacity.json"
    cache.write_text(json.dumps(CAPACITY))
    args = ["--capacity", str(cache), "--duration", "180", "--max", "4", "--warmup", "30"]
    assert plan.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    for trace in ("conversation", "bursty"):
        got = report[trace]
        assert set(got) == {"planner", "reactive", "static", "static_above"}
        for result in got.values():
            assert result["finished"] == result["requests"] > 0
            assert 0 <= result["within_slo"] <= result["requests"]
        # The best of the splits searched, at no more worker-seconds than the planner.
        static = got["static"]
        assert static["worker_seconds"] <= got["planner"]["worker_seconds"]
        above = got["static_above"]
        assert sum(above["split"].values()) == sum(static["split"].values()) + 1
        budget = got["planner"]["worker_seconds"]
        fits = [within for _, _, within, ws in static["searched"] if ws <= budget]
        assert static["within_slo"] == max(fits)
        assert [static["split"]["prefill"], static["split"]["decode"]] in [
            s[:2] for s in static["searched"]
        ]


def test_observed_latency_corrects_a_planner_whose_capacity_is_too_fast():
    # The planner believes workers twice as fast as the simulated ones: its model-based
    # counts come out too low, and the late/slow counts from the workers' observed TTFT
    # and ITL are what add workers back (bench.plan --believed-speedup / --no-observed).
    cap = Capacity(296.0, 0.0213, 0.0051, 64)
    args = plan.parse(["--duration", "900", "--warmup", "60"])
    targets = Targets(args.ttft_s, args.itl_s, min_workers={"prefill": 1, "decode": 1},
                      max_workers={"prefill": 8, "decode": 8}, startup_s=args.startup)  # fmt: skip
    wrong = plan.believed(cap, 2.0)
    assert wrong.prefill_tokens_per_s == 592.0 and wrong.decode_step_base_s == 0.0213 / 2
    runs = {}
    for observed in (True, False):
        decide = plan.planner(wrong, targets, args.scale_down_after, observed=observed)
        runs[observed] = plan._one(plan.bursty(args), args, cap, targets, decide)
    assert runs[True]["requests"] == runs[False]["requests"]
    assert runs[True]["within_slo"] > runs[False]["within_slo"]
    assert runs[True]["worker_seconds"] > runs[False]["worker_seconds"]  # the workers added
