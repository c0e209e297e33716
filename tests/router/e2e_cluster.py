"""A real Tandem cluster for end-to-end router tests: nats-server, two prefill workers, one
decode worker (default model, one torch thread each) and a router, all real processes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from scripts.cluster import LocalCluster
from tests.router.conftest import router_env, router_port

WORKER_ARGS = [
    "--num-threads",
    "1",
    "--kv-cache-mb",
    "128",
    "--transport",
    "tcp",
    "--no-pool",
    "true",
]


class E2ECluster:
    """Workers p1, p2 (prefill) and d1 (decode), and router `router-e2e`. `decode_args`:
    flags the decode worker gets after WORKER_ARGS (a later flag wins)."""

    decode_args: tuple[str, ...] = ()

    def __init__(self, nats_url: str, logs: Path, router_args: list[str]):
        self.nats_url, self.logs = nats_url, logs
        self.cluster = LocalCluster(nats_url, env=router_env(), capture=logs)
        self.router_args = router_args
        self.url = ""

    def start(self, timeout: float = 240.0) -> None:
        for role, sid in (("prefill", "p1"), ("prefill", "p2"), ("decode", "d1")):
            extra = self.decode_args if role == "decode" else ()
            self.cluster.start_one(role, "--service-id", sid, *WORKER_ARGS, *extra)
            self.cluster.procs[sid] = self.cluster.procs.pop(role)
        self.cluster.start_one("router", "--service-id", "router-e2e", "--port", "0",
                               *self.router_args)  # fmt: skip
        port = asyncio.run(router_port(self.nats_url, "router-e2e", timeout))
        self.url = f"http://127.0.0.1:{port}"
        procs = self.cluster.procs
        asyncio.run(wait_healthy(self.url, {"prefill": 2, "decode": 1}, timeout, procs))

    def stop(self) -> dict[str, int]:
        return self.cluster.stop()


async def wait_healthy(
    url: str, workers: dict[str, int], timeout: float, procs: dict | None = None
) -> dict:
    """Poll /health until it is 200 with at least `workers` live per role; raise at once
    if one of `procs` (name -> Popen) exits."""
    deadline = time.monotonic() + timeout
    body: dict = {}
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            for name, proc in (procs or {}).items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}")
            try:
                async with http.get(f"{url}/health") as r:
                    body = await r.json()
                    live = body.get("workers", {})
                    if r.status == 200 and all(live.get(k, 0) >= n for k, n in workers.items()):
                        return body
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{url} not healthy with {workers} within {timeout}s: {body}")


async def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` (exact sample name) whose labels include `labels`."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as r:
        text = await r.text()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


@contextlib.asynccontextmanager
async def openai_client(url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official client on `url`, without its own retries (they would hide errors)."""
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=240
    ) as client:
        yield client


def cluster_fixture(logs: str, router_args: list[str]):
    """A module-scoped `cluster` fixture: an E2ECluster whose router gets `router_args`,
    its processes' logs under a temporary folder named `logs`."""

    @pytest.fixture(scope="module")
    def cluster(module_nats, tmp_path_factory):
        c = E2ECluster(module_nats.url, tmp_path_factory.mktemp(logs), router_args)
        try:
            c.start()
            yield c
        finally:
            c.stop()

    return cluster
