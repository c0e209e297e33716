"""A real cluster: nats-server, the pool (master + store), 2 prefill + 2 decode workers
(d2 with `--role both`).

Starting workers loads the model (seconds each on 2 cores), so the cluster is started once
per session; each test uses its own request ids and prompts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from libs.common.bus.connection import Bus
from libs.common.engine.config import EngineConfig
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.engine import Engine
from libs.common.messages.control import (
    GenerateAccepted,
    GenerateRequest,
    LoadReport,
    SamplingSpec,
    TokenChunk,
    Usage,
)
from scripts.cluster import LocalCluster
from scripts.nats_server import NatsServer

WORKER_ARGS = ["--kv-cache-mb", "48", "--max-num-batched-tokens", "64", "--num-threads", "1",
               "--handoff-timeout", "120"]  # fmt: skip


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    usage: Usage | None
    finish_reason: str | None
    error: str | None
    workers: list[str]
    accepted: GenerateAccepted


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, worker_env) -> Iterator[tuple[str, LocalCluster]]:
    workdir = tmp_path_factory.mktemp("cluster")
    server = NatsServer(workdir / "nats").start()
    cluster = LocalCluster(server.url, env=worker_env, capture=workdir / "logs")
    try:
        cluster.start_one("cache_master", "--service-id", "m1", "--replicas", "1")
        cluster.start_one("cache_store", "--service-id", "s1", "--segment-size", "96MiB")
        # d2 is a `both` worker: a decode worker that also serves prefill for the others.
        workers = (("prefill", "p1", []), ("prefill", "p2", []), ("decode", "d1", []),
                   ("decode", "d2", ["--role", "both"]))  # fmt: skip
        for name, sid, extra in workers:
            cluster.start_one(name, "--service-id", sid, *WORKER_ARGS, *extra, label=sid)
        asyncio.run(_wait_workers(server.url, {"p1", "p2", "d1", "d2"}))
        yield server.url, cluster
    finally:
        cluster.stop()
        server.stop()


async def _wait_workers(url: str, ids: set[str], timeout: float = 180.0) -> None:
    bus = Bus(url, "test-wait", 5, 2)
    await bus.connect()
    try:
        await next_load_reports(bus, ids, timeout)
    finally:
        await bus.close()


async def next_load_reports(bus: Bus, workers: set[str], timeout: float = 10.0) -> dict:
    """Each of `workers`' next load report, by worker id."""
    got: dict[str, LoadReport] = {}
    all_in = asyncio.Event()

    async def on_load(msg) -> None:
        report = LoadReport.decode(msg.data)
        if report.worker in workers:
            got[report.worker] = report
            if workers <= got.keys():
                all_in.set()

    sub = await bus.subscribe("tandem.workers.*.*.load", on_load)
    try:
        async with asyncio.timeout(timeout):
            await all_in.wait()
    finally:
        await sub.unsubscribe()
    return got


@pytest.fixture(scope="session")
def worker_env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["TANDEM_LOG_FORMAT"] = "json"
    return env


async def reference(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of the engine in this process, without prefix cache.

    Prompts run batched: the engine's own tests prove batched equals alone.
    """
    engine = Engine(EngineConfig(kv_cache_mb=48, enable_prefix_cache=False))
    await engine.start()

    async def one(ids: list[int]) -> list[int]:
        out: list[int] = []
        async for o in engine.add_request(ids, SamplingParams(max_tokens=max_tokens,
                                                              temperature=0)):  # fmt: skip
            out += o.token_ids
        return out

    try:
        return list(await asyncio.gather(*(one(ids) for ids in prompts)))
    finally:
        await engine.stop()


async def generate(
    bus: Bus,
    request_id: str,
    token_ids: list[int],
    decode: str,
    prefill: str = "",
    max_tokens: int = 16,
    timeout: float = 120.0,
    generated: list[int] | None = None,
) -> Completion:
    """Send a GenerateRequest and collect its stream, ordered by index. `generated`: a
    continuation's tokens (a migrated request)."""
    subject = f"tandem.stream.{request_id}"
    chunks: list[TokenChunk] = []
    done = asyncio.Event()

    async def on_chunk(msg) -> None:
        chunk = TokenChunk.decode(msg.data)
        chunks.append(chunk)
        if chunk.finish_reason:
            done.set()

    sub = await bus.subscribe(subject, on_chunk)
    try:
        accepted = await bus.request(
            f"tandem.decode.{decode}.generate",
            GenerateRequest(
                request_id=request_id,
                token_ids=token_ids,
                sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0),
                stream_subject=subject,
                prefill_worker=prefill,
                generated=generated or [],
            ),
            GenerateAccepted,
            timeout=30,
        )
        async with asyncio.timeout(timeout):
            await done.wait()
            await asyncio.sleep(0.05)  # a reordered earlier chunk may still be in flight
    finally:
        await sub.unsubscribe()
    chunks.sort(key=lambda c: c.index)
    last = chunks[-1]
    ids = [t for c in chunks for t in c.token_ids]
    return Completion(ids, "".join(c.text for c in chunks), last.usage, last.finish_reason,
                      last.error, sorted({c.worker for c in chunks}), accepted)  # fmt: skip


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of n token ids from ordinary vocabulary."""
    base = [504, 3458, 282, 4649, 314, 253, 1219, 28, 1953, 260, 1345, 2107, 30, 378, 3117]
    return [1] + [base[(i * 7 + seed) % len(base)] + seed for i in range(n - 1)]


@pytest.fixture
async def bus(cluster) -> Bus:
    url, _ = cluster
    b = Bus(url, "test-client", 5, 30)
    await b.connect()
    yield b
    await b.close()
