"""The whole system as real processes, for fault tests, and what the tests measure with.

    nats-server (JetStream, a port kept across restarts)
    cache_master m1 (--replicas 2)     cache_store s1, s2
    prefill p1, p2                     decode d1, d2
    router (HTTP on a free port)

Every process is started by this object and stopped (or killed) by its own pid. A test
that kills one restarts it before it ends (`restart`), so the next test finds the whole
cluster again; starting it costs seconds of model loading, restarting one worker less.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from libs.common.bus import Bus, BusError
from libs.common.engine.engine import Engine
from libs.common.engine.engine_config import EngineConfig
from libs.common.engine.sampling_params import SamplingParams
from libs.common.messages import InfoRequest, KvEvent, LoadReport, PoolStats, ServiceInfo
from scripts.cluster import LocalCluster
from scripts.nats_server import NatsServer
from tests.router.conftest import router_env, router_port
from tests.router.e2e_cluster import wait_healthy

WORKER_ARGS = ("--num-threads", "1", "--kv-cache-mb", "48", "--max-num-batched-tokens", "64",
               "--transport", "tcp", "--handoff-timeout", "60")  # fmt: skip
STORE_ARGS = ("--segment-size", "96MiB", "--transport", "tcp", "--heartbeat-interval", "0.5")
# label -> (service, flags)
TOPOLOGY: dict[str, tuple[str, tuple[str, ...]]] = {
    "m1": ("cache_master", ("--replicas", "2", "--heartbeat-timeout", "10")),
    "s1": ("cache_store", STORE_ARGS),
    "s2": ("cache_store", STORE_ARGS),
    "p1": ("prefill", WORKER_ARGS),
    "p2": ("prefill", WORKER_ARGS),
    "d1": ("decode", WORKER_ARGS),
    "d2": ("decode", WORKER_ARGS),
    # 32 uncached tokens and up go through a prefill worker: most test prompts do
    "router": ("router", ("--port", "0", "--disagg-threshold", "32")),
}
WORKERS = ("p1", "p2", "d1", "d2")


class ChaosCluster:
    """The processes above; `url` is the router's HTTP base once started."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.nats: NatsServer | None = None
        self.local: LocalCluster | None = None
        self.url = ""
        self.want: dict[str, list[str]] = {}  # case name -> greedy reference texts
        self.nats_port = -1
        self._nats_runs = 0

    @property
    def nats_url(self) -> str:
        return self.nats.url

    def start(self, timeout: float = 240.0) -> None:
        """Start everything; meanwhile compute the reference texts of CASES (`want`)."""
        self.start_nats()
        self.local = LocalCluster(self.nats_url, env=router_env(), capture=self.workdir / "logs")
        for label in TOPOLOGY:
            self._spawn(label)

        async def both() -> None:
            self.want = await references(CASES)
            port = await router_port(self.nats_url, "router", timeout)
            self.url = f"http://127.0.0.1:{port}"
            await self.wait_whole(timeout)

        asyncio.run(both())

    async def wait_whole(self, timeout: float = 120.0) -> None:
        """Until every process runs, the router sees 2 + 2 workers and the master 2 stores."""
        for label, alive in self.alive().items():
            if not alive:
                raise RuntimeError(f"{label} is not running; see {self.log_path(label)}")
        await wait_healthy(self.url, {"prefill": 2, "decode": 2}, timeout, self.local.procs)
        bus = await connect(self.nats_url, "chaos-wait")
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        stats = await bus.request("tandem.pool.master.stats", InfoRequest(),
                                                  PoolStats, timeout=2)  # fmt: skip
                        if len(stats.stores) == 2:
                            return
                    except BusError:
                        pass
                    await asyncio.sleep(0.2)
        finally:
            await bus.close()

    def start_nats(self) -> None:
        """(Re)start nats-server on the same port, with an empty JetStream store each time
        (a restart that loses the server's state, the harder case)."""
        self._nats_runs += 1
        workdir = self.workdir / f"nats-{self._nats_runs}"
        self.nats = NatsServer(workdir, port=self.nats_port).start()
        self.nats_port = self.nats.port

    def _spawn(self, label: str) -> None:
        service, flags = TOPOLOGY[label]
        self.local.start_one(service, "--service-id", label, *flags, label=label)

    def pid(self, label: str) -> int:
        return self.local.procs[label].pid

    def kill(self, label: str) -> None:
        """kill -9 one service process (ours, by pid) and reap it."""
        proc = self.local.procs[label]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def kill_nats(self) -> None:
        self.nats.kill()

    def restart(self, label: str) -> None:
        """Start `label` again with its flags (after `kill`)."""
        if self.local.procs[label].poll() is None:
            raise RuntimeError(f"{label} is still running")
        self._spawn(label)

    def alive(self) -> dict[str, bool]:
        return {label: proc.poll() is None for label, proc in self.local.procs.items()}

    def log_path(self, label: str) -> Path:
        return self.workdir / "logs" / f"{label}.log"

    def stop(self) -> None:
        if self.local is not None:
            self.local.stop()
        if self.nats is not None:
            self.nats.stop()


# --- greedy references ----------------------------------------------------------------


def prompt_ids(n: int, seed: int) -> list[int]:
    """A deterministic prompt of n ordinary token ids; distinct seeds share no first page."""
    base = [504, 3458, 282, 4649, 314, 253, 1219, 28, 1953, 260, 1345, 2107, 30, 378, 3117]
    return [1] + [base[(i * 7 + seed) % len(base)] + 3 * seed for i in range(n - 1)]


@dataclass(frozen=True)
class Case:
    """Prompts a test sends, with its sampling (greedy)."""

    prompts: list[list[int]]
    max_tokens: int
    ignore_eos: bool = False


# What the tests send, in one place, so that one engine computes every reference at once.
CASES = {
    "decode_kill": Case([prompt_ids(40 + 8 * i, seed=10 + i) for i in range(4)], 48, True),
    "after_decode_kill": Case([prompt_ids(48, seed=20 + i) for i in range(2)], 12),
    "prefill_kill": Case([prompt_ids(150 + 4 * i, seed=30 + i) for i in range(6)], 8),
    "store_kill": Case([prompt_ids(100, seed=40), prompt_ids(120, seed=41)], 8),
    "master_kill": Case([prompt_ids(70 + 10 * i, seed=50 + i) for i in range(6)], 6),
    "nats_restart": Case([prompt_ids(60 + 10 * i, seed=60 + i) for i in range(6)], 6),
    "nats_blip": Case([prompt_ids(50 + 10 * i, seed=80 + i) for i in range(4)], 64, True),
}


async def references(cases: dict[str, Case]) -> dict[str, list[str]]:
    """Greedy texts of the engine in this process, no prefix cache, one torch thread (as
    the workers). All batched: the engine's tests prove batched equals alone."""
    engine = Engine(EngineConfig(kv_cache_mb=96, enable_prefix_cache=False, num_threads=1))
    await engine.start()

    async def one(ids: list[int], params: SamplingParams) -> str:
        return "".join([o.text async for o in engine.add_request(ids, params)])

    async def case(c: Case) -> list[str]:
        params = SamplingParams(max_tokens=c.max_tokens, temperature=0, ignore_eos=c.ignore_eos)
        return list(await asyncio.gather(*(one(ids, params) for ids in c.prompts)))

    try:
        texts = await asyncio.gather(*(case(c) for c in cases.values()))
    finally:
        await engine.stop()
    return dict(zip(cases, texts, strict=True))


# --- what a client sees -----------------------------------------------------------------


@dataclass
class Outcome:
    """One completion as the client saw it: HTTP status, text, and the error if any."""

    status: int
    text: str = ""
    error: str = ""
    usage: dict = field(default_factory=dict)
    seconds: float = 0.0
    events: int = 0  # SSE data events (streams)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def body(ids: list[int], max_tokens: int, ignore_eos: bool, stream: bool = False) -> dict:
    return {"model": "default", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": ignore_eos, "stream": stream}  # fmt: skip


async def complete(
    http: aiohttp.ClientSession, url: str, ids: list[int], max_tokens: int, ignore_eos: bool,
    timeout: float = 90.0,
) -> Outcome:  # fmt: skip
    """A non-streaming completion; never raises for HTTP or connection errors."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            async with http.post(f"{url}/v1/completions",
                                 json=body(ids, max_tokens, ignore_eos)) as r:  # fmt: skip
                data = await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError) as e:
        return Outcome(0, error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - start)
    took = time.monotonic() - start
    if r.status != 200:
        return Outcome(r.status, error=str(data.get("error", data)), seconds=took)
    return Outcome(200, data["choices"][0]["text"], usage=data.get("usage", {}), seconds=took)


class Stream:
    """A streaming completion read in the background: `text` grows, `outcome` at the end."""

    def __init__(self, http: aiohttp.ClientSession, url: str, ids: list[int], max_tokens: int,
                 ignore_eos: bool, timeout: float = 120.0):  # fmt: skip
        self.text, self.tokens, self.ended_at = "", 0, 0.0
        self.outcome: Outcome | None = None
        self.task = asyncio.create_task(
            self._run(http, url, body(ids, max_tokens, ignore_eos, stream=True), timeout)
        )

    async def _run(self, http, url: str, req: dict, timeout: float) -> Outcome:
        start, error, status, events = time.monotonic(), "", 0, 0
        try:
            async with asyncio.timeout(timeout):
                async with http.post(f"{url}/v1/completions", json=req) as r:
                    status = r.status
                    if status != 200:
                        error = (await r.text())[:500]
                    else:
                        async for raw in r.content:
                            line = raw.decode().strip()
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            events += 1
                            event = orjson.loads(line[6:])
                            if "error" in event:
                                error = event["error"].get("message", str(event["error"]))
                                continue
                            for choice in event.get("choices", []):
                                self.text += choice.get("text", "")
                                self.tokens += 1
        except (aiohttp.ClientError, TimeoutError) as e:
            error = f"{type(e).__name__}: {e}"
        self.ended_at = time.monotonic()
        self.outcome = Outcome(status, self.text, error, seconds=self.ended_at - start,
                               events=events)  # fmt: skip
        return self.outcome

    async def wait_tokens(self, n: int, timeout: float = 60.0) -> None:
        async with asyncio.timeout(timeout):
            while self.tokens < n:
                if self.task.done():
                    raise AssertionError(f"stream ended early: {self.task.result()}")
                await asyncio.sleep(0.05)


# --- what the services report ---------------------------------------------------------


async def connect(url: str, name: str) -> Bus:
    bus = Bus(url, name, connect_timeout=10, request_timeout=5)
    await bus.connect()
    return bus


async def free_pages(bus: Bus, worker: str, want: int | None = None, timeout: float = 10):
    """Free pages (free + evictable cached) from `worker`'s load reports: the next one, or
    with `want`, the first report showing it (the last seen when none does in time)."""
    seen: list[int] = []
    matched = asyncio.Event()

    async def on_load(msg) -> None:
        seen.append(LoadReport.decode(msg.data).free_pages)
        if want is None or seen[-1] == want:
            matched.set()

    sub = await bus.subscribe(f"tandem.workers.*.{worker}.load", on_load)
    try:
        await asyncio.wait_for(matched.wait(), timeout)
    except TimeoutError:
        pass
    finally:
        await sub.unsubscribe()
    if not seen:
        raise AssertionError(f"{worker} sent no load report within {timeout}s")
    return seen[-1]


async def info(bus: Bus, service: str, sid: str) -> dict:
    reply = await bus.request(f"tandem.{service}.{sid}.info", InfoRequest(), ServiceInfo)
    return reply.details


async def wait_reporting(bus: Bus, workers: Iterable[str], timeout: float = 120.0) -> None:
    """Until every one of `workers` has sent a load report."""
    for worker in workers:
        await free_pages(bus, worker, timeout=timeout)


class PoolWatch:
    """Keys the pool holds, per store, from the KV events (tier `pool`) seen since `start`."""

    def __init__(self, bus: Bus):
        self.bus = bus
        self.held: dict[str, set[str]] = {}
        self._changed = asyncio.Event()
        self._sub = None

    async def start(self) -> PoolWatch:
        self._sub = await self.bus.subscribe("tandem.kv.events.>", self._on_event)
        return self

    async def _on_event(self, msg) -> None:
        event = KvEvent.decode(msg.data)
        if event.tier != "pool":
            return
        keys = self.held.setdefault(event.source, set())
        if event.kind == "stored":
            keys.update(event.keys)
        elif event.kind == "removed":
            keys.difference_update(event.keys)
        elif event.kind == "cleared":
            keys.clear()
        self._changed.set()

    def keys(self) -> set[str]:
        return set().union(*self.held.values()) if self.held else set()

    async def wait_for(self, keys: Iterable[str], stores: Iterable[str], timeout: float = 30):
        """Until every key is held by every store in `stores`."""
        keys, stores = set(keys), list(stores)
        async with asyncio.timeout(timeout):
            while not all(keys <= self.held.get(s, set()) for s in stores):
                self._changed.clear()
                await self._changed.wait()

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
