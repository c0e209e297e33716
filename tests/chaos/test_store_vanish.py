"""A cache store that vanishes from the network, with no RST and no ICMP, under load.

    root namespace           ns <tag>-p                          ns <tag>-d
    nats-server, router,     workers w1, w2 (--role both)        cache_store s1, on
    cache_master m1, test    cache_store s2, on 10.200.0.1 ==veth== 10.200.0.2; its bus
                             bus relays: 127.0.0.1, 10.200.0.1   through 10.200.0.1

s1 reaches everything, the bus included, only across the veth, so cutting the link
(every packet dropped on arrival, both ways: `LinkedNamespaces.cut("drop")`) is what a
store host that loses power or its switch port looks like: connections stay open with
nothing coming back, and new ones get no answer. Every object has a replica on s1 and
one on s2 (--replicas 2); the load rotates more prompts than a worker's L1 holds, so
requests keep reading their prefixes from the pool across the cut.

The pool is a cache, so the clients must see nothing: every request completes (200) with
the greedy reference text, within a bound the timeouts give (see POOL_FALLTHROUGH_S);
the master drops s1 within its heartbeat timeout; after the link is back, s1 mounts again.

Needs root and nft: skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from libs.common.bus.connection import BusError
from libs.common.messages.control import InfoRequest
from libs.common.messages.pool import PoolStats
from scripts.cluster import REPO, LocalCluster
from tests.chaos.cases import Case, prompt_ids, references
from tests.chaos.load import Load
from tests.chaos.netns import D_ADDR, P_ADDR, LinkedNamespaces, drop_unavailable, unavailable
from tests.chaos.reports import connect
from tests.router.conftest import router_env, router_port
from tests.router.e2e_cluster import wait_healthy

pytestmark = pytest.mark.slow

HEARTBEAT_S = 0.5  # the stores' --heartbeat-interval
DEAD_AFTER_S = 10.0  # the master's --heartbeat-timeout
SWEEP_S = 0.5  # the master's --sweep-interval (its default)
STALL_S = 10.0  # the workers' --transfer-stall-timeout (default): TCP_USER_TIMEOUT, keepalive
CONNECT_S = 5.0  # TcpTransferEngine's connect_timeout_s (default)
POOL_RPC_S = 5.0  # PoolClient's timeout (default) on each request to the master
# The longest a request's pool read can take across the cut before it falls through to
# s2 or to recomputing: batch_exists and batch_get answered at their timeouts, then the
# read on a connection to s1 that was granted just before the cut fails after STALL_S,
# and its one retry on a fresh connection after CONNECT_S. (A get asked after the cut is
# not slowed by s1: the master's read grant from s1 times out after 2 s and the reply
# leaves s1's replicas out.) A worker reads one prefix at a time, so a request queued
# behind one such read waits for it, and then pays a fresh connect at most.
POOL_FALLTHROUGH_S = 2 * POOL_RPC_S + STALL_S + CONNECT_S
SLACK_S = 15.0  # scheduling on 2 shared cores, 3 clients on 2 single-thread workers
CASE = Case([prompt_ids(100, seed=90 + i) for i in range(8)], 8)  # 8 x 6 full pages

WORKER_ARGS = ["--num-threads", "1", "--kv-cache-mb", "24", "--max-num-batched-tokens", "64",
               "--transport", "tcp"]  # fmt: skip
STORE_ARGS = ["--segment-size", "96MiB", "--transport", "tcp",
              "--heartbeat-interval", str(HEARTBEAT_S)]  # fmt: skip
MASTER_ARGS = ["--replicas", "2", "--heartbeat-timeout", str(DEAD_AFTER_S),
               "--sweep-interval", str(SWEEP_S)]  # fmt: skip


class Cluster:
    """The processes above, each started and stopped here by its pid."""

    def __init__(self, ns: LinkedNamespaces, nats_port: int, logs: Path):
        self.ns, self.logs, self.procs = ns, logs, {}
        self.nats_url = f"nats://127.0.0.1:{nats_port}"
        ns.relay_nats(nats_port)
        self.d_nats_url = ns.relay_nats_across(nats_port)
        self.local = LocalCluster(self.nats_url, env=router_env(), capture=logs)

    def _in_ns(self, where: str, args: list[str], nats_url: str) -> None:
        role, sid = args[0], args[1]
        argv = [sys.executable, "-m", f"services.{role}", "--nats-url", nats_url,
                "--service-id", sid, *args[2:]]  # fmt: skip
        with open(self.logs / f"{sid}.log", "ab") as out:
            self.procs[sid] = subprocess.Popen(
                self.ns.command(where, argv), cwd=REPO, env=router_env(),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def start(self) -> None:
        p, d, url = self.ns.p, self.ns.d, self.nats_url
        self.local.start_one("cache_master", "--service-id", "m1", *MASTER_ARGS, label="m1")
        self._in_ns(d, ["cache_store", "s1", "--transfer-host", D_ADDR, *STORE_ARGS],
                    self.d_nats_url)  # fmt: skip
        self._in_ns(p, ["cache_store", "s2", "--transfer-host", P_ADDR, *STORE_ARGS], url)
        for sid in ("w1", "w2"):
            self._in_ns(p, ["decode", sid, "--role", "both", *WORKER_ARGS], url)
        self.local.start_one("router", "--service-id", "router-sv", "--port", "0",
                             label="router")  # fmt: skip

    def stop(self) -> None:
        self.local.stop()
        procs = list(self.procs.values())
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _stats(bus) -> PoolStats | None:
    try:
        return await bus.request("tandem.pool.master.stats", InfoRequest(), PoolStats, timeout=1)
    except BusError:
        return None


async def _until_stores(bus, present: bool, timeout: float) -> tuple[float, PoolStats]:
    """Poll the master (every 0.1 s, at most `timeout`) until s1 is listed (`present`) or
    not; return the seconds it took and the stats then."""
    start = time.monotonic()
    for _ in range(int(timeout / 0.1) + 1):
        stats = await _stats(bus)
        if stats is not None and ("s1" in stats.stores) == present:
            return time.monotonic() - start, stats
        if time.monotonic() - start > timeout:
            break
        await asyncio.sleep(0.1)
    raise AssertionError(f"s1 {'never mounted' if present else 'still listed'} "
                         f"after {timeout:.0f}s: {stats}")  # fmt: skip


async def _warm(bus, load: Load) -> PoolStats:
    """Until every prompt completed once, both stores hold objects, and pool gets hit."""
    await load.wait_rounds(1, timeout=240)
    for _ in range(600):  # 60 s
        stats = await _stats(bus)
        ready = stats is not None and len(stats.stores) == 2 and stats.hits > 0
        if ready and min(s["objects"] for s in stats.stores.values()) > 0:
            return stats
        await asyncio.sleep(0.1)
    raise AssertionError(f"the pool never held and served objects on both stores: {stats}")


@pytest.fixture
def namespaces():
    reason = unavailable() or drop_unavailable()
    if reason:
        pytest.skip(f"store vanish: {reason}")
    ns = LinkedNamespaces()
    try:
        yield ns.create()
    finally:
        ns.close()


async def test_store_vanishing_without_rst_under_load_costs_only_recompute(
    namespaces: LinkedNamespaces, nats_server, tmp_path: Path
):
    ns, logs = namespaces, tmp_path / "logs"
    logs.mkdir()
    cluster = Cluster(ns, nats_server.port, logs)
    cluster.start()
    timeout = aiohttp.ClientTimeout(total=120)
    bus = None
    try:
        want = await references({"v": CASE})  # while the processes load
        port = await router_port(cluster.nats_url, "router-sv", 240)
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url, {"both": 2}, 240, cluster.procs)
        bus = await connect(cluster.nats_url, "chaos-vanish")
        async with aiohttp.ClientSession(timeout=timeout) as http:
            load = await Load(http, url, CASE, want["v"], concurrency=3).start()
            try:
                figures = await _across_the_cut(ns, bus, load)
            finally:
                await load.stop()
    finally:
        if bus is not None:
            await bus.close()
        cluster.stop()
        if os.environ.get("TANDEM_KEEP_LOGS"):
            print(f"logs: {logs}")
    _check(load, figures)


async def _across_the_cut(ns: LinkedNamespaces, bus, load: Load) -> dict:
    before = await _warm(bus, load)
    warm_worst = max(s.outcome.seconds for s in load.sent)
    await asyncio.sleep(1.0)  # the load runs on: reads are in flight
    ns.cut("drop")
    cut_at = time.monotonic()
    dead_s, dead = await _until_stores(bus, present=False, timeout=DEAD_AFTER_S + 20)
    await load.wait_completed(load.completed + 3, timeout=90)  # served by s2 alone
    ns.restore()
    restored_at = time.monotonic()
    remount_s, after = await _until_stores(bus, present=True, timeout=90)
    await load.wait_completed(load.completed + 6, timeout=120)  # and on after it
    await load.stop()
    across = [s for s in load.sent if s.ended > cut_at]
    return {
        "cut_at": cut_at, "restored_at": restored_at, "dead_s": dead_s,
        "remount_s": remount_s, "warm_worst": warm_worst, "before": before, "dead": dead,
        "after": after, "across": across,
        "in_flight": [s for s in across if s.ended - s.outcome.seconds < cut_at],
    }  # fmt: skip


def _check(load: Load, f: dict) -> None:
    assert load.failed() == [], [(s.prompt, s.outcome) for s in load.failed()]
    assert load.wrong() == [], [(s.prompt, s.outcome.text) for s in load.wrong()]
    assert f["before"].stores["s1"]["objects"] > 0  # s1 held replicas when it vanished
    assert f["in_flight"], "no request was in flight at the cut"
    assert f["dead"].hits > f["before"].hits, "no pool get after the warm-up"
    # the master's sweep runs every SWEEP_S; the last heartbeat was up to HEARTBEAT_S old
    assert f["dead_s"] <= DEAD_AFTER_S + SWEEP_S + HEARTBEAT_S + 1.0, f["dead_s"]
    worst = max(s.outcome.seconds for s in f["across"])
    bound = f["warm_worst"] + POOL_FALLTHROUGH_S + SLACK_S
    assert worst <= bound, (worst, bound)
    during = sum(f["cut_at"] < s.ended < f["restored_at"] for s in load.sent)
    print(
        f"\nstore vanish: s1 declared dead {f['dead_s']:.1f}s after the cut "
        f"(--heartbeat-timeout {DEAD_AFTER_S:g}); {len(f['in_flight'])} requests in flight "
        f"at the cut, {during} completed while cut, {len(load.sent)} in all, failed 0, "
        f"wrong 0; worst latency across the cut {worst:.1f}s (bound {bound:.1f}s, "
        f"before the cut {f['warm_worst']:.1f}s); s1 re-mounted {f['remount_s']:.1f}s after "
        f"the link came back; pool hits {f['before'].hits} -> {f['after'].hits}"
    )
