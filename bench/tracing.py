"""What tracing costs: the same serving load with tracing off and on, in one run.

    python -m bench.tracing                                # 32 streams, 2 rounds
    python -m bench.tracing --rounds 3 --json tracing.json
    python -m bench.tracing --micro                        # µs per span, in-process

Each configuration is a cluster of the same build (its own nats-server, 2 prefill workers,
1 decode worker, a router; the default model; tcp transport; `--kernel-choice native`, so
that no start times its own kernels), measured with bench.serve's `random` workload:

    off     no --otlp-endpoint (the default)
    on      every service exports to an OTLP/HTTP sink in this process, which counts what
            it gets and answers as a collector does (it decodes the spans only after the
            rounds: its cost is not the services')
    before  with --before DIR only: the services of another checkout (the code before
            tracing, e.g. `git worktree add DIR 724cdb4^`), same interpreter and flags

All configurations are started once, side by side, and stay up; each round then loads
each of them in turn, the order rotating from round to round, so that a drift of the
shared host's load lands on each and differences between two starts of one build (5-8%
when each start measured its kernel choice) do not enter the ratios. The table gives each
configuration's mean over its rounds, on / off and off / before, and each one's CPU time a
request (every process of the cluster, nats-server included, over the measured rounds).

The bound: what tracing off can cost a request is at most every helper call site in
services/ and libs/ (counted in this run, from the source: `tracing.<helper>(...)`) once
per output token and once more, at the off path's measured µs a call (`--micro`'s, timed
in this run too); its share of the off cluster's CPU a request is printed with the table.
`--micro` alone times the helpers themselves in this process (libs/common/tracing.py):
a span off, a span on (into an exporter that drops it) and the traceparent header.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import shutil
import sys
import timeit
from pathlib import Path
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SpanExportResult

from bench import report
from bench.client import Endpoint
from bench.deployments import Deployment, Topology
from bench.serve import add_workload_args, benchmark, make_arrivals, make_workload, served_model
from libs.common import event_loop, tracing
from scripts.cluster import REPO

METRICS = (("output_throughput", "output tok/s"), ("ttft_ms", "mean TTFT ms"),
           ("tpot_ms", "mean TPOT ms"), ("e2e_ms", "mean E2E ms"))  # fmt: skip


HELPERS = frozenset({"span", "record", "annotate", "event", "now", "headers", "remote", "joined",
                     "enabled"})  # fmt: skip


class Sink:
    """An OTLP/HTTP endpoint that counts export requests and their bytes, and keeps the
    bodies to count their spans once the rounds are over (`spans`)."""

    def __init__(self) -> None:
        self.requests = self.bytes = 0
        self.bodies: list[bytes] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._export)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def _export(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.requests, self.bytes = self.requests + 1, self.bytes + len(body)
        self.bodies.append(body)
        # an empty ExportTraceServiceResponse is zero bytes of protobuf
        return web.Response(body=b"", content_type="application/x-protobuf")

    def spans(self) -> int:
        """Spans in every export received (OTLP protobuf, decoded here, after the rounds)."""
        count = 0
        for body in self.bodies:
            message = ExportTraceServiceRequest()
            message.ParseFromString(body)
            count += sum(len(scope.spans) for rs in message.resource_spans
                         for scope in rs.scope_spans)  # fmt: skip
        return count

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def call_sites(root: Path = REPO) -> int:
    """Calls of a tracing helper (`tracing.<helper>(...)`) in services/ and libs/, outside
    libs/common/tracing.py itself: what tracing off leaves in the code."""
    own = root / "libs" / "common" / "tracing.py"
    count = 0
    for top in ("services", "libs"):
        for path in sorted((root / top).rglob("*.py")):
            if path == own:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                func = getattr(node, "func", None) if isinstance(node, ast.Call) else None
                if (
                    isinstance(func, ast.Attribute)
                    and func.attr in HELPERS
                    and isinstance(func.value, ast.Name)
                    and func.value.id == "tracing"
                ):
                    count += 1
    return count


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes so far (/proc/<pid>/stat, every thread);
    a process gone counts nothing."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)
    return total


def topology(name: str, a: argparse.Namespace, sink: Sink) -> Topology:
    traced = ["--otlp-endpoint", sink.url] if name == "on" else []
    workers = ["--num-threads", str(a.threads), "--transport", "tcp", "--no-pool", "true",
               "--kernel-choice", a.kernel_choice, *traced]  # fmt: skip
    return Topology(name, 2, 1, workers, {}, router_args=traced, note=f"tracing {name}")


def pids(system: Deployment) -> list[int]:
    procs = list(system.cluster.procs.values()) if system.cluster else []
    if system.nats is not None and system.nats.proc is not None:
        procs.append(system.nats.proc)
    return [p.pid for p in procs]


async def start(name: str, a: argparse.Namespace, sink: Sink) -> Deployment:
    """One configuration's cluster, up and warmed by one request."""
    workdir = a.workdir / name
    shutil.rmtree(workdir, ignore_errors=True)  # no KV events of an earlier run
    system = Deployment(topology(name, a, sink), workdir,
                        repo=a.before if name == "before" else REPO)  # fmt: skip
    await system.start(a.ready_timeout)
    endpoint = Endpoint(system.url, await served_model(system.url), timeout=300)
    warm = make_workload(argparse.Namespace(**{**vars(a), "num_prompts": 1,
                                               "input_len": 16, "seed": 999}))  # fmt: skip
    await benchmark(endpoint, warm, make_arrivals(a), progress=False)
    return system


async def run_one(name: str, system: Deployment, a: argparse.Namespace, sink: Sink,
                  round_: int) -> dict[str, Any]:  # fmt: skip
    endpoint = Endpoint(system.url, await served_model(system.url), timeout=300)
    exported, cpu = sink.requests, cpu_seconds(pids(system))
    run = await benchmark(endpoint, make_workload(a), make_arrivals(a), None,
                          not a.no_progress, label=f"{name} {round_}")  # fmt: skip
    run["cpu_s"] = cpu_seconds(pids(system)) - cpu
    run["exports"] = sink.requests - exported
    run["load"] = os.getloadavg()
    return run


def micro(n: int = 100_000) -> dict[str, float]:
    """µs per call of the tracing helpers, off and on (spans into an exporter that drops
    them: what the services pay, without the export thread's encoding)."""

    class Drop:
        def export(self, spans: Any) -> Any:
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

        def force_flush(self, timeout_millis: int = 0) -> bool:
            return True

    def one_span() -> None:
        with tracing.span("x", "r", a=1):
            tracing.headers()

    out = {"off_span_us": timeit.timeit(one_span, number=n) / n * 1e6}
    tracing.setup("bench", "bench", "", exporter=Drop())
    try:
        with tracing.span("root", "r", context=tracing.joined(None)):
            out["on_span_us"] = timeit.timeit(one_span, number=n // 10) / (n // 10) * 1e6
    finally:
        tracing.shutdown()
    return out


def table(runs: dict[str, list[dict[str, Any]]], bound: dict[str, float] | None = None) -> str:
    def mean(name: str, key: str) -> float:
        values = [r["summary"][key] for r in runs[name]]
        values = [v["mean"] if isinstance(v, dict) else v for v in values]
        return sum(values) / len(values)

    names = [n for n in ("before", "off", "on") if runs.get(n)]
    ratios = [("on", "off")] + ([("off", "before")] if "before" in names else [])
    lines = [f"{'':16}" + "".join(f"{n:>12}" for n in names)
             + "".join(f"{f'{x} / {y}':>14}" for x, y in ratios)]  # fmt: skip
    for key, label in METRICS:
        means = {n: mean(n, key) for n in names}
        lines.append(f"{label:16}" + "".join(f"{means[n]:12.1f}" for n in names)
                     + "".join(f"{means[x] / means[y]:14.3f}" for x, y in ratios))  # fmt: skip
    if all("cpu_s" in r for rs in runs.values() for r in rs):
        cpu = {n: cpu_ms_per_request(runs[n]) for n in names}
        lines.append(f"{'CPU ms / request':16}" + "".join(f"{cpu[n]:12.1f}" for n in names)
                     + "".join(f"{cpu[x] / cpu[y]:14.3f}" for x, y in ratios))  # fmt: skip
    done = {n: sum(r["summary"]["completed"] for r in rs) for n, rs in runs.items()}
    lines.append(f"completed: {done}; exports to the sink (on): "
                 f"{sum(r['exports'] for r in runs['on'])}")  # fmt: skip
    if bound:
        lines.append(
            f"tracing off, at most: {bound['call_sites']} call sites x {bound['calls_per_site']} "
            f"(output tokens + 1) x {bound['off_call_us']:.3f} µs = "
            f"{bound['off_cost_ms']:.3f} ms a request, {100 * bound['share']:.3f}% of the off "
            f"cluster's {bound['off_cpu_ms']:.1f} CPU ms a request; spans a request (on): "
            f"{bound['spans_per_request']:.1f}")  # fmt: skip
    return "\n".join(lines)


def cpu_ms_per_request(runs: list[dict[str, Any]]) -> float:
    done = sum(r["summary"]["completed"] for r in runs)
    return 1e3 * sum(r["cpu_s"] for r in runs) / max(done, 1)


def off_bound(runs: dict[str, list[dict[str, Any]]], output_len: int, sites: int,
              off_call_us: float, spans: int) -> dict[str, float]:  # fmt: skip
    """What tracing off can cost a request at most, against what a request costs."""
    per_site = output_len + 1
    cost_ms = sites * per_site * off_call_us / 1e3
    off_cpu = cpu_ms_per_request(runs["off"])
    sent_on = sum(r["summary"]["completed"] for r in runs["on"]) + 1  # and its warm-up
    return {"call_sites": sites, "calls_per_site": per_site, "off_call_us": off_call_us,
            "off_cost_ms": cost_ms, "off_cpu_ms": off_cpu, "share": cost_ms / max(off_cpu, 1e-9),
            "spans_per_request": spans / sent_on}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.tracing",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=4, help="rounds; each loads every configuration")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--workdir", type=Path, default=REPO / "run" / "bench-tracing")
    p.add_argument("--json", type=Path, help="write every round's results")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--micro", action="store_true", help="only time the helpers, in-process")
    p.add_argument("--before", type=Path, help="a checkout of older code: also run its services")
    p.add_argument(
        "--kernel-choice",
        default="native",
        choices=("native", "measure"),
        help="the workers' --kernel-choice (measure: each start times its own)",
    )
    add_workload_args(p)
    p.set_defaults(workload="random", num_prompts=96, input_len=256, output_len=32,
                   max_concurrency=32, duration=900.0)  # fmt: skip
    return p


async def _main(a: argparse.Namespace) -> int:
    if a.micro:
        print(json.dumps({k: round(v, 3) for k, v in micro().items()}))
        return 0
    if a.rounds < 1 or a.threads < 1:
        raise ValueError("--rounds and --threads must be >= 1")
    make_workload(a), make_arrivals(a)  # flag errors before any start
    if a.before is not None and not (a.before / "services" / "router").is_dir():
        raise ValueError(f"--before {a.before}: not a checkout of this repository")
    sink = Sink()
    await sink.start()
    names = ["before", "off", "on"] if a.before is not None else ["off", "on"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    systems: dict[str, Deployment] = {}
    try:
        for name in names:
            print(f"== start {name} (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
            systems[name] = await start(name, a, sink)
        for round_ in range(a.rounds):
            turn = round_ % len(names)
            for name in names[turn:] + names[:turn]:
                print(f"== {name} round {round_} (load {os.getloadavg()[0]:.2f})",
                      file=sys.stderr, flush=True)  # fmt: skip
                runs[name].append(await run_one(name, systems[name], a, sink, round_))
        # in a thread: the on services' last exports, at their exit, reach the sink here
        await asyncio.to_thread(systems.pop("on").stop)
    finally:
        for system in systems.values():
            await asyncio.to_thread(system.stop)
        await sink.stop()
    helpers = micro()  # on a quiet host now: every cluster is down
    bound = off_bound(runs, a.output_len, call_sites(), helpers["off_span_us"], sink.spans())
    print(table(runs, bound))
    if a.json:
        report.write_json(a.json, {"args": {k: str(v) for k, v in vars(a).items()}, "runs": runs,
                                   "micro": helpers, "off_bound": bound})  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        return event_loop.run(_main(a))
    except ValueError as e:
        print(f"bench.tracing: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
