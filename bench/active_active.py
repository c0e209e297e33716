"""Routing quality with two routers active-active: cache hit rate through one router vs
through both, on one cluster, the same multi-turn workload shape.

    python -m bench.active_active --json aa.json

One deployment (its own nats-server): 2 prefill workers with their prefix caches, 1 decode
worker, no pool (a hit is only where the router sent a conversation's earlier turns), and
two routers. bench.serve's multi-turn workload runs alternately through router 1 alone and
through both, round robin per request (so a conversation's turns alternate between the
routers: each must know from the KV events where the other sent the earlier ones). Each
run has its own seed (fresh conversations: no run hits what another left). The figure
that matters is the hit-rate gap, two minus one, in points (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.client import Endpoint
from bench.deployments import Deployment, Topology
from bench.serve import add_workload_args, benchmark, make_arrivals, make_workload, served_model
from libs.common import event_loop


def topology(a: argparse.Namespace) -> Topology:
    common = ["--num-threads", str(a.threads), "--transport", "tcp", "--no-pool", "true"]
    kv = {"prefill": ["--kv-cache-mb", str(a.prefill_kv_mb)], "decode": ["--kv-cache-mb", "96"]}
    return Topology("two-routers", 2, 1, common, kv, routers=2,
                    note="2 prefill (L1) + 1 decode, no pool, 2 routers")  # fmt: skip


async def measure(a: argparse.Namespace, urls: list[str]) -> dict[str, dict[str, Any]]:
    model = await served_model(urls[0])
    runs: dict[str, dict[str, Any]] = {}
    for r in range(a.repeats):
        kinds = [("one router", urls[:1]), ("two routers", urls)]
        for name, bases in kinds[:: -1 if r % 2 else 1]:  # neither always runs first
            a.seed = a.base_seed + len(runs)
            endpoint = Endpoint(",".join(bases), model, timeout=a.request_timeout)
            label = f"{name} #{r + 1}"
            run = await benchmark(endpoint, make_workload(a), make_arrivals(a), None,
                                  False, label)  # fmt: skip
            runs[label] = run
            s = run["summary"]
            print(f"{label}: {s['completed']}/{s['requests']} ok, hit rate "
                  f"{s['cache_hit_rate']:.1%}", flush=True)  # fmt: skip
    return runs


def gap(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Mean hit rate of each kind of run, and two minus one in points."""
    mean = {}
    for kind in ("one router", "two routers"):
        rates = [run["summary"]["cache_hit_rate"] for label, run in runs.items()
                 if label.startswith(kind)]  # fmt: skip
        mean[kind] = sum(rates) / len(rates)
    return {"one_router": mean["one router"], "two_routers": mean["two routers"],
            "gap_points": 100 * (mean["two routers"] - mean["one router"])}  # fmt: skip


async def run(a: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="tandem-aa-"))
    deployment = Deployment(topology(a), workdir)
    try:
        await deployment.start()
        runs = await measure(a, deployment.urls)
    finally:
        deployment.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    result = gap(runs)
    print(f"\n{report.compare_table(runs)}\n")
    print(f"hit rate: one router {result['one_router']:.1%}, two routers "
          f"{result['two_routers']:.1%}, gap {result['gap_points']:+.1f} points")  # fmt: skip
    if a.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "args": {k: str(v) for k, v in vars(a).items()}}
        report.write_json(a.json, {"meta": meta, "result": result, "runs": runs})
    return 0 if all(r["summary"]["failed"] == 0 for r in runs.values()) else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.active_active",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    add_workload_args(p)
    p.set_defaults(workload="multi-turn", num_clients=8, num_rounds=4, input_len=128,
                   question_len=32, output_len=8, max_concurrency=4)  # fmt: skip
    g = p.add_argument_group("deployment")
    g.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    g.add_argument("--prefill-kv-mb", type=int, default=256, help="each prefill worker's KV")
    g.add_argument("--repeats", type=int, default=2, help="runs of each kind")
    g.add_argument("--base-seed", type=int, default=100)
    g.add_argument("--json", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.repeats < 1:
        print("bench.active_active: --repeats must be >= 1", file=sys.stderr)
        return 2
    return event_loop.run(run(a))


if __name__ == "__main__":
    sys.exit(main())
