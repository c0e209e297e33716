"""`make upgrade-test`: a rolling, in-place upgrade of the compose stack under load.

Every container of compose.yaml is recreated from the image, one at a time, while a
multi-turn load runs through the router; the KV cache must survive (the stores keep their
segment and SSD files on their volumes, a standby master takes over, workers drain) and
no request may fail.

Steps (each one fails the run with a message saying which):
  1. image and Docker as `make compose-test` (scripts/compose_stack.py)
  2. `up -d --profile ha`: compose.yaml's stack (two masters) plus a second decode worker
     (decode_2), 512 MiB store segments; wait until every service is healthy
  3. before: cohort B's first round, then cohort A's rounds 0..R-1 (multi-turn
     conversations of bench.workloads.MultiTurn, two seeds, same shape)
  4. upgrade: each running service in turn `up -d --no-deps --force-recreate` (SIGTERM,
     the service's drain within stop_grace_period, then a new container of the image on
     the same volumes), waited healthy, then --settle seconds, before the next; a
     background multi-turn load runs all along
  5. after: cohort B's rounds 1..R-1. Every worker's own prefix cache is new, so B's
     history can only come from the pool that the stores kept
  6. JSON on stdout; `down -v` (always, unless --keep)

Figures: the hit rate is usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens
summed over a cohort's rounds 1..R-1 (the router's exact usage, L1 and pool hits alike):
`hit_rate_before` is cohort A's (all before the upgrade), `hit_rate_after` cohort B's
(history cached before the upgrade, the next rounds after it): the same shape of
conversation, so only the upgrade differs. Goals: `failed_requests` 0, the two hit rates
within 5 points; the exit status is 1 when either is missed.

A client retries what the router refused before accepting it (connection refused or
closed before the response while the router itself restarts, HTTP 503/429 with
Retry-After: nothing was generated), every second for up to --retry-for seconds, as a
client or load balancer in front of one router does; `retries` counts them by reason and
by restart. A request that fails otherwise, or still after that, is a failed request.

    python -m scripts.upgrade_test [--rounds 3] [--clients 8] [--settle 5] [--keep]

Logs: run/upgrade-test/ (compose logs, the env file, result.json).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import time
from collections import Counter
from typing import Any

import aiohttp

from bench.client import Endpoint
from bench.workloads import MultiTurn
from scripts.compose_stack import (
    IMAGE,
    REPO,
    SERVICES,
    Stack,
    StepFailed,
    build_image,
    ensure_base_image,
    ensure_dockerd,
    ensure_tools,
    fill_wheels,
    run_folder,
    step,
    tear_down,
)
from scripts.upgrade_load import Load, Phase, Record, background

WORKDIR = REPO / "run" / "upgrade-test"
PROJECT = "tandem-upgrade-test"
HA_SERVICES = (*SERVICES, "decode_2")
# Restart order: the bus first; the masters (the standby before the leader, so that the
# pool hands over once); stores; workers; the router last.
ORDER = ("nats", "cache_master_2", "cache_master", "cache_store_1", "cache_store_2",
         "prefill", "decode", "decode_2", "router")  # fmt: skip
MASTERS = {"cache_master": "master-1", "cache_master_2": "master-2"}  # compose.yaml's ids
HIT_RATE_GOAL = 0.05  # |after - before|


def wait_service_healthy(stack: Stack, service: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        state = stack.states().get(service)
        if state == "healthy":
            return
        if state in ("exited", "dead", "unhealthy"):
            raise StepFailed(f"{service} is {state} after its restart")
        time.sleep(1)
    raise StepFailed(f"{service} not healthy within {timeout:g}s of its restart (last: {state})")


def restart_all(stack: Stack, services: list[str], timeout: float, settle: float) -> list[dict]:
    """Recreate each service in turn; [{service, begin, recreate_s, healthy_s, end}]. A
    recreated container's logs go with it: they are saved first, to logs/<service>.log."""
    done = []
    run_folder(WORKDIR / "logs")
    for service in services:
        logs = stack("logs", "--no-color", "--timestamps", service, capture=True, echo=False)
        (WORKDIR / "logs" / f"{service}.log").write_text(logs)
        begin = time.time()
        print(f"   restarting {service}", flush=True)
        stack("up", "-d", "--no-deps", "--force-recreate", "--no-build", service, echo=False)
        recreated = time.time()
        wait_service_healthy(stack, service, timeout)
        healthy = time.time()
        print(f"   {service}: recreated in {recreated - begin:.1f}s, healthy "
              f"{healthy - begin:.1f}s after its stop began", flush=True)  # fmt: skip
        time.sleep(settle)
        done.append({"service": service, "begin": begin, "recreate_s": round(recreated - begin, 1),
                     "healthy_s": round(healthy - begin, 1), "end": time.time()})  # fmt: skip
    return done


POOL_EVENTS = ("elected pool master leader", "leadership released", "store mounted")


def pool_events(logs: list[str]) -> list[dict[str, Any]]:
    """The masters' election and the stores' mounts, in time order, from compose logs."""
    events = []
    for line in (x for text in logs for x in text.splitlines()):
        _, _, rest = line.partition(" | ")
        _, _, body = rest.partition(" ")
        if not any(e in body for e in POOL_EVENTS):
            continue
        try:
            e = json.loads(body)
        except ValueError:
            continue
        facts = {k: e[k] for k in ("store", "objects", "rejected", "epoch") if k in e}
        events.append({"t": e.get("timestamp", ""), "master": e.get("service_id", ""),
                       "event": e.get("event", ""), **facts})  # fmt: skip
    return sorted(events, key=lambda e: e["t"])


def takeovers(events: list[dict[str, Any]], restarts: list[dict]) -> list[dict[str, Any]]:
    """Each election during a master's restart: seconds from its stop to the election
    (the pool answers no request between the two)."""
    out = []
    for r in restarts:
        if r["service"] not in MASTERS:
            continue
        for e in events:
            if e["event"] == "elected pool master leader" and e["master"] != MASTERS[r["service"]]:
                t = _seconds(e["t"])
                if r["begin"] <= t <= r["end"]:
                    out.append({"stopped": MASTERS[r["service"]], "elected": e["master"],
                                "takeover_s": round(t - r["begin"], 2)})  # fmt: skip
    return out


def leader(events: list[dict[str, Any]]) -> str | None:
    """The compose service of the master elected last, if any."""
    elected = [e["master"] for e in events if e["event"] == "elected pool master leader"]
    by_id = {v: k for k, v in MASTERS.items()}
    return by_id.get(elected[-1]) if elected else None


def _seconds(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp).timestamp()


def master_logs(stack: Stack) -> str:
    return stack("logs", "--no-color", "--timestamps", *MASTERS, capture=True, echo=False)


def during(rec: Record, restarts: list[dict]) -> list[str]:
    return [r["service"] for r in restarts if rec.began <= r["end"] and rec.ended >= r["begin"]]


async def scenario(stack: Stack, a: argparse.Namespace) -> dict[str, Any]:
    from bench.serve import served_model

    base_url = f"http://127.0.0.1:{stack.ports['router']}/v1"
    model = await served_model(base_url)
    endpoint = Endpoint(base_url, model, timeout=a.request_timeout)
    shape = dict(clients=a.clients, rounds=a.rounds, request_len=a.input_len,
                 question_len=a.question_len, output_len=a.output_len)  # fmt: skip
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        load = Load(http, endpoint, a.retry_for)
        step("before: cohort B's round 0, cohort A's rounds 0..R-1")
        cohort_b = Phase(MultiTurn(**shape, seed=2), until=1)
        await load.run("B", cohort_b, a.concurrency)
        await load.run("A", MultiTurn(**shape, seed=1), a.concurrency)
        step("upgrade: every service recreated in turn, under a background load")
        running = stack.states()
        services = [s for s in ORDER if s in running]
        first = leader(pool_events([master_logs(stack)]))
        standby = next((m for m in MASTERS if m != first), None)
        if first in services and standby in services:  # the leader after the standby
            services.remove(first)
            services.insert(services.index(standby) + 1, first)
        stop = asyncio.Event()
        bg = asyncio.create_task(background(load, stop, a.background_concurrency))
        began = time.time()
        try:
            restarts = await asyncio.to_thread(
                restart_all, stack, services, a.service_timeout, a.settle
            )
        finally:
            stop.set()
            batches = await bg
        upgrade_s = time.time() - began
        step("after: cohort B's rounds 1..R-1")
        await load.run("B", Phase(cohort_b.inner, until=a.rounds, first=cohort_b.held),
                       a.concurrency)  # fmt: skip
    saved = WORKDIR / "logs"
    masters = [(saved / f"{m}.log").read_text() for m in ("cache_master_2", "cache_master")]
    masters.append(master_logs(stack))
    events = pool_events(masters)
    rows = [{"label": r.label, "began": r.began, "ended": r.ended, "retries": r.retries,
             **r.result.as_json()} for r in load.records]  # fmt: skip
    (WORKDIR / "requests.json").write_text(json.dumps({"restarts": restarts, "requests": rows}))
    handovers = takeovers(events, restarts)
    result = report(load, restarts, upgrade_s, batches, a)
    result["leader_before"] = MASTERS.get(first or "")
    result["master_takeovers"] = handovers
    result["pool_events"] = events
    return result


def report(load: Load, restarts: list[dict], upgrade_s: float, batches: int,
           a: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    rounds = range(1, a.rounds)
    before, after = load.hit_rate("A", rounds), load.hit_rate("B", rounds)
    failed = [r for r in load.records if not r.result.ok]
    retries: Counter[str] = Counter(x for r in load.records for x in r.retries)
    windows = {r["service"]: [x for x in load.records if r["service"] in during(x, restarts)]
               for r in restarts}  # fmt: skip
    failures = [{"label": r.label, "round": r.result.round, "error": r.result.error[:200],
                 "during": during(r, restarts)} for r in failed[:20]]  # fmt: skip
    for r in restarts:
        mine = windows[r["service"]]
        del r["begin"], r["end"]
        r.update(requests=len(mine), failed=sum(not x.result.ok for x in mine),
                 retried=sum(bool(x.retries) for x in mine))  # fmt: skip
    bg = [r for r in load.records if r.label == "background"]
    background = {"requests": len(bg), "failed": sum(not r.result.ok for r in bg),
                  "batches": batches}  # fmt: skip
    workload = {k: getattr(a, k) for k in ("clients", "rounds", "input_len", "question_len",
                                           "output_len", "concurrency", "settle")}  # fmt: skip
    return {
        "test": "make upgrade-test",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": f"{platform.node()} ({platform.machine()}, {len(os.sched_getaffinity(0))} cpus)",
        "image": IMAGE,
        "failed_requests": len(failed),
        "requests": len(load.records),
        "hit_rate_before": before["hit_rate"],
        "hit_rate_after": after["hit_rate"],
        "hit_rate_goal_points": HIT_RATE_GOAL * 100,
        "cohort_before": before,
        "cohort_after": after,
        "background": background,
        "retries": dict(retries),
        "retried_requests": sum(bool(r.retries) for r in load.records),
        "upgrade_s": round(upgrade_s, 1),
        "restarts": restarts,
        "failures": failures,
        "workload": workload,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="make upgrade-test", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--clients", type=int, default=8, help="conversations per cohort")
    p.add_argument("--rounds", type=int, default=3, help="rounds per conversation (>= 2)")
    p.add_argument("--input-len", type=int, default=256, help="words of a first question")
    p.add_argument("--question-len", type=int, default=64, help="words of a later question")
    p.add_argument("--output-len", type=int, default=4, help="tokens of each answer")
    p.add_argument("--concurrency", type=int, default=4, help="cohort requests in flight")
    p.add_argument("--background-concurrency", type=int, default=2,
                   help="background conversations during the upgrade")  # fmt: skip
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds after a restarted service is healthy before the next")  # fmt: skip
    p.add_argument("--service-timeout", type=float, default=300.0,
                   help="seconds for one restarted service to be healthy")  # fmt: skip
    p.add_argument("--retry-for", type=float, default=60.0,
                   help="seconds a refused request is retried")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to get healthy")
    p.add_argument("--keep", action="store_true", help="leave the stack up at the end")
    a = p.parse_args(argv)
    if a.rounds < 2:
        p.error("--rounds: must be >= 2 (round 0 before the upgrade, the rest after)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    run_folder(WORKDIR)
    dockerd, stack, result, code = None, None, None, 1
    try:
        step("tools, Docker engine, base image, wheels, image (as make compose-test)")
        compose = ensure_tools(need_debootstrap=True)
        dockerd = ensure_dockerd(WORKDIR)
        ensure_base_image()
        fill_wheels(REPO / "deploy" / "wheels")
        build_image()
        segment = "TANDEM_CACHE_STORE_SEGMENT_SIZE=512MiB"
        stack = Stack(compose, project=PROJECT, workdir=WORKDIR, services=HA_SERVICES,
                      profiles=("ha",), env=(segment,))  # fmt: skip
        step("compose up -d --profile ha")
        stack("down", "-v", "--remove-orphans", check=False)
        stack("up", "-d", "--no-build")
        stack.wait_healthy(a.timeout)
        result = asyncio.run(scenario(stack, a))
        missed = []
        if result["failed_requests"]:
            missed.append(f"{result['failed_requests']} failed requests")
        gap = abs(result["hit_rate_after"] - result["hit_rate_before"])
        if gap > HIT_RATE_GOAL:
            missed.append(f"hit rate moved {gap * 100:.1f} points")
        result["goals_met"] = not missed
        (WORKDIR / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        code = 0 if not missed else 1
        if missed:
            print(f"\nGOAL MISSED: {'; '.join(missed)}", file=sys.stderr, flush=True)
    except StepFailed as e:
        print(f"\nFAILED: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
    finally:
        tear_down(stack, dockerd, keep=a.keep, failed=code != 0)
    if result is not None:
        print(json.dumps(result, indent=2), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
