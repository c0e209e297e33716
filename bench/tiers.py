"""The cache-tier experiment: one multi-turn workload against several configurations.

    python -m bench.tiers                       # all configurations (minutes each)
    python -m bench.tiers --configs baseline,L1,L1+pool --plot tiers.png --json tiers.json

Each configuration of the same build is started from scratch (its own nats-server, workers
and router), measured with bench.serve's workload through the router, and stopped:

    baseline       2 prefill + 1 decode, prefix cache off, no pool
    L1             2 prefill + 1 decode, each worker's own prefix cache, no pool
    L1+pool        2 prefill + 1 decode, prefix cache + KV pool (cache_master, cache_store)
    disaggregated  1 prefill + 1 decode, prefix cache, no pool, router always disaggregates
    aggregated     2 `--role both` workers, each prefilling its own requests (router
                   --disagg-threshold above any prompt)
    peer           `transformers serve` (continuous batching) on the same weights, or
                   llama.cpp's server (--peer llama.cpp), when installed (--peer-python)
    small-pool     L1+pool with a store segment smaller than the workload's pages
                   (--small-segment): the pool evicts what the next rounds need
    small-pool+ssd the same DRAM with an SSD tier under it (--ssd-size, files in the
                   workdir): evicted pages spill to SSD and are promoted back on a hit

Workers' KV memory is small on purpose (--prefill-kv-mb, --decode-kv-mb): on a GPU the
seeds' L1 overflows because of long contexts and many users; here the same pressure comes
from a small pool, so that what L1 evicts is what the pool keeps. One table at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.client import Endpoint
from bench.deployments import PEER_KINDS, Deployment, PeerServer, Topology
from bench.metrics import Slo
from bench.serve import add_workload_args, benchmark, make_arrivals, make_workload, served_model
from libs.common import event_loop
from libs.common.bus.connection import Bus
from libs.common.engine.load.source import default_model_path
from libs.common.messages.control import InfoRequest
from libs.common.messages.pool import PoolStats
from scripts.cluster import REPO

CONFIGS = ("baseline", "L1", "L1+pool", "disaggregated", "aggregated", "peer")
SSD_CONFIGS = ("small-pool", "small-pool+ssd")  # not in the default list: ask for them


def topologies(a: argparse.Namespace) -> dict[str, Topology]:
    common = ["--num-threads", str(a.threads), "--transport", "tcp"]
    kv = {"prefill": ["--kv-cache-mb", str(a.prefill_kv_mb)],
          "decode": ["--kv-cache-mb", str(a.decode_kv_mb)]}  # fmt: skip
    off = [*common, "--no-prefix-cache", "true", "--no-pool", "true"]
    no_pool = [*common, "--no-pool", "true"]
    topos = [
        Topology("baseline", 2, 1, off, kv, note="no prefix cache, no pool"),
        Topology("L1", 2, 1, no_pool, kv, note="prefix cache, no pool"),
        Topology("L1+pool", 2, 1, common, kv, pool=True, note="prefix cache + pool"),
        # Its one prefill worker gets a decode worker's KV size: the same memory as the
        # two decode workers of `aggregated`.
        Topology(
            "disaggregated",
            1,
            1,
            no_pool,
            {"prefill": kv["decode"], "decode": kv["decode"]},
            router_args=["--disagg-threshold", "0"],
            note="1P+1D, L1, always disaggregated",
        ),
        # Two `both` workers; a threshold above any prompt makes each prefill its own
        # requests (no KV moves between them).
        Topology(
            "aggregated",
            0,
            0,
            no_pool,
            kv,
            router_args=["--disagg-threshold", "1000000"],
            note="2 `--role both` workers, each prefilling its own requests, L1",
            both=2,
        ),
        Topology("small-pool", 2, 1, common, kv, pool=True, store_segment=a.small_segment,
                 note=f"prefix cache + pool of {a.small_segment} DRAM"),
        Topology("small-pool+ssd", 2, 1, common, kv, pool=True, store_segment=a.small_segment,
                 ssd_size=a.ssd_size,
                 note=f"prefix cache + pool of {a.small_segment} DRAM + {a.ssd_size} SSD"),
    ]  # fmt: skip
    return {t.name: t for t in topos}


async def run_one(name: str, a: argparse.Namespace, topo: dict[str, Topology]) -> dict[str, Any]:
    workdir = a.workdir / name.replace("+", "_")
    # A fresh nats store each time: a router replays the KV events JetStream keeps, and
    # events of an earlier run would describe caches that no longer exist.
    shutil.rmtree(workdir, ignore_errors=True)
    started = time.time()
    load_before = os.getloadavg()
    ignore_eos, model = True, ""
    if name == "peer":
        peer = PeerServer(a.peer, a.peer_python, Path(a.peer_model or default_model_path()),
                          workdir, a.peer_threads)  # fmt: skip
        why = peer.available()
        if why:
            return {"note": f"not run: {why}"}
        system: Deployment | PeerServer = peer
        ignore_eos, model = peer.ignore_eos, peer.model_name
        note = f"{a.peer}, {a.peer_threads} threads" + ("" if ignore_eos else ", no ignore_eos")
    else:
        system = Deployment(topo[name], workdir, a.store_segment)
        note = topo[name].note
    try:
        await system.start(a.ready_timeout)
        model = model or await served_model(system.url)
        endpoint = Endpoint(system.url, model, ignore_eos=ignore_eos, timeout=a.request_timeout)
        if a.warmup:
            # One short request first, so one-time costs (first allocation, lazy imports)
            # do not land on the first measured request; its prefix is not reused.
            warm = make_workload(argparse.Namespace(**{**vars(a), "workload": "random",
                                 "num_prompts": 1, "input_len": 16, "seed": 999}))  # fmt: skip
            await benchmark(endpoint, warm, make_arrivals(a), progress=False)
        run = await benchmark(endpoint, make_workload(a), make_arrivals(a), Slo.parse(a.slo),
                              not a.no_progress, label=name)  # fmt: skip
        if isinstance(system, Deployment) and system.topo.pool:
            run["pool"] = await pool_stats(system.nats.url)
    except (RuntimeError, TimeoutError, OSError, ValueError) as e:
        return {"note": f"failed: {e}"}
    finally:
        system.stop()
    run["note"] = note
    run["meta"] = {"started": started, "load_before": load_before, "load_after": os.getloadavg()}
    return run


async def pool_stats(nats_url: str) -> dict[str, Any]:
    """The master's counters after the run (hits, evictions, the SSD tier's), or {}."""
    bus = Bus(nats_url, "bench-tiers", connect_timeout=5, request_timeout=5)
    try:
        await bus.connect()
        stats = await bus.request("tandem.pool.master.stats", InfoRequest(), PoolStats)
        keys = ("objects", "bytes", "capacity", "hits", "misses", "evictions", "ssd")
        return {k: getattr(stats, k) for k in keys}
    except Exception as e:  # a report without the pool's counters, not a failed run
        return {"error": str(e)}
    finally:
        await bus.close()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.tiers",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma list of {CONFIGS + SSD_CONFIGS}")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--prefill-kv-mb", type=int, default=48, help="KV pool of a prefill worker")
    p.add_argument("--decode-kv-mb", type=int, default=112, help="KV pool of a decode worker")
    p.add_argument("--store-segment", default="512MiB", help="cache_store segment size")
    p.add_argument("--small-segment", default="192MiB",
                   help="small-pool*: a segment below the workload's pages")  # fmt: skip
    p.add_argument("--ssd-size", default="2GiB", help="small-pool+ssd: the SSD tier's size")
    p.add_argument("--peer", choices=PEER_KINDS, default="transformers", help="which peer")
    p.add_argument(
        "--peer-python",
        default=os.environ.get("TANDEM_PEER_PYTHON", ""),
        help="interpreter that runs the peer (env TANDEM_PEER_PYTHON)",
    )
    p.add_argument(
        "--peer-model",
        default="",
        help="llama.cpp: GGUF (default: the default model's); transformers: HF folder",
    )
    p.add_argument("--peer-threads", type=int, default=2, help="threads of the peer")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument(
        "--workdir",
        type=Path,
        default=REPO / "run" / "bench-tiers",
        help="nats stores and service logs",
    )
    p.add_argument("--json", type=Path, help="write every configuration's results")
    p.add_argument("--plot", type=Path, help="PNG: TTFT and throughput by configuration, per round")
    p.add_argument("--no-progress", action="store_true")
    add_workload_args(p)
    p.add_argument("--no-round-barrier", dest="round_barrier", action="store_false")
    # 8 conversations, 4 in flight: the decode worker's KV holds the running batch and
    # about one more conversation, so what L1 keeps between rounds is capacity-bound.
    # Short answers: on CPU cores a decode step is slow (docs/benchmarks.md, bench.tiers),
    # and long answers would make every configuration's run time decode time, hiding what
    # the cache tiers change.
    p.set_defaults(workload="multi-turn", num_clients=8, num_rounds=6, input_len=256,
                   question_len=32, output_len=8, round_barrier=True, max_concurrency=4,
                   duration=900.0)  # fmt: skip
    return p


async def _main(a: argparse.Namespace) -> int:
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    bad = [n for n in names if n not in CONFIGS + SSD_CONFIGS]
    if bad or not names:
        raise ValueError(f"--configs: unknown {bad}; choose from {CONFIGS + SSD_CONFIGS}")
    for flag in ("threads", "prefill_kv_mb", "decode_kv_mb", "peer_threads"):
        if getattr(a, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1")
    make_workload(a), make_arrivals(a), Slo.parse(a.slo)  # flag errors before any start
    topo = topologies(a)
    runs: dict[str, dict[str, Any]] = {}
    for name in names:
        print(f"== {name} (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
        runs[name] = await run_one(name, a, topo)
        if runs[name].get("summary"):
            print(report.summary_table(runs[name]["summary"]), file=sys.stderr, flush=True)
            if name in SSD_CONFIGS:  # the comparison is per round: print the rounds
                print(f"\n{name}, per round:\n{report.rounds_table(runs[name]['rounds'])}\n"
                      f"pool: {runs[name].get('pool')}", flush=True)  # fmt: skip
        else:
            print(runs[name]["note"], file=sys.stderr, flush=True)
    print(f"\n{report.compare_table(runs)}")
    if a.json:
        args = {k: str(v) for k, v in vars(a).items()}
        report.write_json(a.json, {"args": args, "runs": runs})
    if a.plot and any(r.get("summary") for r in runs.values()):
        report.plot(runs, a.plot, title="multi-turn: configurations of the same build")
    return 0 if all(r.get("summary") or name == "peer" for name, r in runs.items()) else 1


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        return event_loop.run(_main(a))
    except ValueError as e:
        print(f"bench.tiers: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
