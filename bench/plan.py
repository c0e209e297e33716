"""`python -m bench.plan`: the planner against a static split and a TTFT/ITL-only policy.

Replays two traces through bench/plan_sim.py's cluster, whose workers run at the
throughput measured on the real engine (bench/plan_model.py, cached): the shared
conversation trace (/work/shared/traces, Mooncake FAST'25; prompt and output lengths and
time scaled by flags) and a bursty synthetic one (Poisson arrivals, quiet and burst
phases). Policies, each bounded by the same --min/--max per role:

- static: the best fixed split at no more worker-seconds than the planner's, chosen with
  hindsight: every split P+D = the planner's mean total count rounded down (each within
  --min/--max; and of one fewer where some cost more than the planner) is replayed; from
  the one with the most requests within SLO, a worker fewer of a role while that keeps as
  many, repeated, is `static` (`searched`: every split replayed); `static_above`: the best
  split of one worker more (it costs more than the planner: an integer split can not match
  its worker-seconds). Or --static P,D alone;
- reactive: Dynamo-like, on observed TTFT and ITL only: the p90 of the requests finished
  in the last interval above the SLO adds a worker to that role, under half of it removes
  one (same hysteresis as the planner);
- planner: services/planner/policy.py's `Planner`, the service's own decision function,
  fed the `LoadReport`s the workers would publish (queue time included).

Every policy starts at its own counts, ready at time 0. The first --warmup seconds are
not scored (their requests, and worker-seconds before it), so a policy's cold start at
--min workers does not count against it. Prints one JSON object: per trace and policy the
requests within both SLOs, TTFT/ITL p90 and worker-seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
from pathlib import Path

import msgspec

from bench.plan_model import DEFAULT_CACHE, capacity_of, load_or_measure
from bench.plan_sim import Cluster, Req, Run, simulate
from libs.common.log import setup_logging
from services.planner.policy import Capacity, Hysteresis, Planner, Targets

TRACE = Path("/work/shared/traces/conversation_trace.jsonl")


def conversation(args: argparse.Namespace) -> list[Req]:
    out = []
    with open(args.trace) as f:
        for line in f:
            row = json.loads(line)
            at = row["timestamp"] / 1000.0 / args.time_scale
            if at > args.duration:
                break
            prompt = max(1, round(row["input_length"] / args.prompt_scale))
            out.append(Req(at, prompt, max(1, round(row["output_length"] / args.output_scale))))
    return out


def bursty(args: argparse.Namespace) -> list[Req]:
    """Quiet phases at --bursty-rate requests/s, every third phase at 5x (phases of
    --bursty-phase seconds)."""
    rng = random.Random(args.seed)
    out, now = [], 0.0
    while now < args.duration:
        rate = args.bursty_rate * (5.0 if int(now // args.bursty_phase) % 3 == 1 else 1.0)
        now += rng.expovariate(rate)
        prompt = max(16, int(rng.lognormvariate(math.log(args.bursty_prompt), 0.6)))
        out.append(Req(now, prompt, max(2, int(rng.lognormvariate(math.log(32), 0.5)))))
    return out


def p90(values: list[float]) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(0.9 * len(values)))]


def reactive(targets: Targets, after_s: float):
    hysteresis = Hysteresis(after_s)

    def decide(_reports, finished, current, now):
        want = dict(current)
        for role, seen, slo in (("prefill", [r.ttft for r in finished], targets.ttft_s),
                                ("decode", [r.itl for r in finished], targets.itl_s)):  # fmt: skip
            if seen and p90(seen) > slo:
                want[role] = current[role] + 1
            elif seen and p90(seen) < slo / 2:
                want[role] = current[role] - 1
            want[role] = targets.clamp(role, want[role])
        return hysteresis.decide(current, want, now)

    return decide


def planner(cap: Capacity, targets: Targets, after_s: float, observed: bool = True):
    """The planner's policy. `observed=False`: it never sees the workers' observed TTFT and
    ITL (the ablation of its late/slow counts)."""
    plan = Planner(cap, targets, Hysteresis(after_s))

    def decide(reports, _finished, current, now):
        if not observed:
            reports = [msgspec.structs.replace(r, ttft_p90_s=0.0, itl_p90_s=0.0) for r in reports]
        return plan.decide(reports, current, now).counts

    return decide


def believed(cap: Capacity, speedup: float) -> Capacity:
    """What a planner given a capacity `speedup` times too fast believes (its flags or its
    --measure run were from faster hardware)."""
    return Capacity(cap.prefill_tokens_per_s * speedup, cap.decode_step_base_s / speedup,
                    cap.decode_step_per_seq_s / speedup, cap.decode_seats)  # fmt: skip


def score(trace: list[Req], result: dict, targets: Targets, warmup_s: float = 0.0) -> dict:
    trace = [r for r in trace if r.arrival >= warmup_s]
    ok = [
        r
        for r in trace
        if r.done is not None and r.ttft <= targets.ttft_s and r.itl <= targets.itl_s
    ]
    ws = result["worker_seconds"]
    return {
        "requests": len(trace),
        "finished": sum(1 for r in trace if r.done is not None),
        "within_slo": len(ok),
        "within_slo_frac": round(len(ok) / max(1, len(trace)), 4),
        "ttft_over_slo": sum(1 for r in trace if r.first_token is None or r.ttft > targets.ttft_s),
        "itl_over_slo": sum(1 for r in trace if r.done is None or r.itl > targets.itl_s),
        "ttft_p90_s": round(p90([r.ttft for r in trace if r.first_token is not None]), 3),
        "itl_p90_s": round(p90([r.itl for r in trace if r.done is not None]), 4),
        "worker_seconds": round(ws["prefill"] + ws["decode"], 1),
        "worker_seconds_by_role": {k: round(v, 1) for k, v in ws.items()},
        "scale_changes": result["scale_changes"],
    }


def compare(make_trace, args: argparse.Namespace, cap: Capacity, targets: Targets) -> dict:
    """The planner, the reactive policy, then the static splits at the planner's mean.
    The planner's --mean-prompt-tokens and --mean-output-tokens are the trace's means (what
    an operator would set)."""
    sample = make_trace(args)
    mean_prompt = sum(r.prompt for r in sample) / max(1, len(sample))
    mean_output = sum(r.output for r in sample) / max(1, len(sample))
    targets = dataclasses.replace(
        targets, mean_prompt_tokens=mean_prompt, mean_output_tokens=mean_output
    )
    policies = {
        "planner": planner(
            believed(cap, args.believed_speedup),
            targets,
            args.scale_down_after,
            observed=not args.no_observed,
        ),
        "reactive": reactive(targets, args.scale_down_after),
    }
    out = {name: _one(make_trace(args), args, cap, targets, decide)
           for name, decide in policies.items()}  # fmt: skip
    if args.static:
        split = dict(zip(("prefill", "decode"), map(int, args.static.split(",")), strict=True))
        out["static"] = {**_static(make_trace, args, cap, targets, split), "split": split}
        return out
    out["static"] = best_static(make_trace, args, cap, targets, out["planner"])
    if "split" in out["static"]:  # the next total up: what a split costing more keeps
        total = mean_total(out["planner"], args) + 1
        out["static_above"] = _best_of(make_trace, args, cap, targets, total) or {
            "skipped": f"no split of {total} workers within --min/--max"
        }
    return out


def _static(make_trace, args, cap: Capacity, targets: Targets, split: dict[str, int]) -> dict:
    return _one(make_trace(args), args, cap, targets, lambda *_: split, start=split)


def splits_within(total: int, targets: Targets) -> list[dict[str, int]]:
    """Every split of `total` workers with each role's count within its bounds."""
    low, high = targets.min_workers, targets.max_workers
    return [{"prefill": p, "decode": total - p} for p in range(low["prefill"], high["prefill"] + 1)
            if low["decode"] <= total - p <= high["decode"]]  # fmt: skip


def mean_total(planner_run: dict, args: argparse.Namespace) -> int:
    """The planner's mean count of workers over the scored time, rounded down."""
    return math.floor(planner_run["worker_seconds"] / max(1e-9, planner_run["end_s"] - args.warmup))


def best_static(make_trace, args, cap: Capacity, targets: Targets, planner_run: dict) -> dict:
    """The most requests within SLO of any split costing no more than the planner, and the
    cheapest split found that keeps as many (see `_cheapest`). A worker more never keeps
    fewer within SLO, so the splits of the planner's mean total, and of one fewer where
    some of those cost more than it (a static run may end later), hold the best."""
    budget, total = planner_run["worker_seconds"], mean_total(planner_run, args)
    runs: list[dict] = []
    while total >= 2:
        tried = [{**_static(make_trace, args, cap, targets, s), "split": s}
                 for s in splits_within(total, targets)]  # fmt: skip
        runs += tried
        if tried and all(r["worker_seconds"] <= budget for r in tried):
            break
        total -= 1
    fits = [r for r in runs if r["worker_seconds"] <= budget]
    if not fits:
        return {"skipped": "no split of 2 or more workers within the planner's worker-seconds"}
    best = max(fits, key=lambda r: (r["within_slo"], -r["worker_seconds"]))
    searched = [_entry(r) for r in runs]
    return _cheapest(make_trace, args, cap, targets, {**best, "searched": searched})


def _best_of(make_trace, args, cap, targets, total: int) -> dict | None:
    """The best split of `total` workers (within --min/--max), whatever it costs."""
    runs = [{**_static(make_trace, args, cap, targets, s), "split": s}
            for s in splits_within(total, targets)]  # fmt: skip
    return max(runs, key=lambda r: (r["within_slo"], -r["worker_seconds"])) if runs else None


def _entry(run: dict) -> list:
    """[prefill, decode, within SLO, worker-seconds] of a static run (`searched`)."""
    return [run["split"]["prefill"], run["split"]["decode"], run["within_slo"],
            run["worker_seconds"]]  # fmt: skip


def _cheapest(make_trace, args, cap, targets, best: dict) -> dict:
    """`best` with one worker fewer of a role while that keeps as many within SLO."""
    searched = best["searched"]
    while True:
        fewer = []
        for role in ("prefill", "decode"):
            split = {**best["split"], role: best["split"][role] - 1}
            if split[role] >= max(1, targets.min_workers[role]):
                run = {**_static(make_trace, args, cap, targets, split), "split": split}
                searched.append(_entry(run))
                fewer += [run] if run["within_slo"] >= best["within_slo"] else []
        if not fewer:
            return {**best, "searched": searched}
        best = min(fewer, key=lambda r: r["worker_seconds"])


def _one(trace: list[Req], args: argparse.Namespace, cap: Capacity, targets: Targets,
         decide, start: dict[str, int] | None = None) -> dict:  # fmt: skip
    cluster = Cluster(cap, args.startup)
    cluster.scale(dict(start or targets.min_workers), 0.0, ready=0.0)
    run = Run(dt=args.dt, interval=args.interval, warmup_s=args.warmup)
    result = simulate(trace, cluster, decide, run)
    return {**score(trace, result, targets, args.warmup), "end_s": round(result["end_s"], 1)}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.plan", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--capacity", type=Path, default=DEFAULT_CACHE, help="measured capacity (JSON cache)"
    )
    ap.add_argument("--measure", action="store_true", help="measure the engine again")
    ap.add_argument(
        "--threads", type=int, default=1, help="engine threads per worker when measuring"
    )
    ap.add_argument("--seats", type=int, default=64, help="a decode worker's --max-num-seqs")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of (scaled) trace")
    ap.add_argument("--time-scale", type=float, default=1.0, help="trace time divided by this")
    ap.add_argument(
        "--prompt-scale", type=float, default=64.0, help="prompt lengths divided by this"
    )
    ap.add_argument(
        "--output-scale", type=float, default=8.0, help="output lengths divided by this"
    )
    ap.add_argument("--bursty-rate", type=float, default=1.0, help="quiet-phase requests/s")
    ap.add_argument("--bursty-prompt", type=float, default=256.0, help="median prompt tokens")
    ap.add_argument("--bursty-phase", type=float, default=60.0, help="seconds of each bursty phase")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-s", type=float, default=2.0, help="TTFT SLO, seconds")
    ap.add_argument("--itl-s", type=float, default=0.1, help="ITL SLO (a request's mean), seconds")
    ap.add_argument("--min", type=int, default=1, help="fewest workers per role")
    ap.add_argument("--max", type=int, default=8, help="most workers per role")
    ap.add_argument(
        "--static",
        default="",
        help="a static split PREFILL,DECODE (default: the best split at no more "
        "worker-seconds than the planner, searched)",
    )
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds at the start not scored")
    ap.add_argument("--startup", type=float, default=10.0, help="seconds until a new worker serves")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between decisions")
    ap.add_argument(
        "--scale-down-after",
        type=float,
        default=60.0,
        help="seconds of less before one worker goes",
    )
    ap.add_argument(
        "--flow-window",
        type=float,
        default=600.0,
        help="the planner's --flow-window: seconds of arrivals whose peak caps decode's flow "
        "count (0: decode planned for prefill flat out, the planner before)",
    )
    ap.add_argument("--dt", type=float, default=0.05, help="simulation tick, seconds")
    ap.add_argument(
        "--believed-speedup",
        type=float,
        default=1.0,
        help="the planner's capacity is this many times the simulated workers' (a capacity "
        "measured on other hardware); observed TTFT/ITL are what it has to correct it",
    )
    ap.add_argument(
        "--no-observed",
        action="store_true",
        help="hide the workers' observed TTFT/ITL p90 from the planner (ablation)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    setup_logging(level="warning")  # the engine's info lines would mix into the JSON
    measured = load_or_measure(args.capacity, args.measure, args.threads, args.seats)
    cap = capacity_of(measured)
    bounds = {"min_workers": {"prefill": args.min, "decode": args.min},
              "max_workers": {"prefill": args.max, "decode": args.max}}  # fmt: skip
    targets = Targets(args.ttft_s, args.itl_s, **bounds, startup_s=args.startup,
                      flow_window_s=args.flow_window)  # fmt: skip
    report = {
        "capacity": measured,
        "slo": {"ttft_s": args.ttft_s, "itl_s": args.itl_s},
        "conversation": compare(conversation, args, cap, targets)
        if args.trace.exists()
        else {"skipped": f"no trace at {args.trace}"},
        "bursty": compare(bursty, args, cap, targets),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
