"""One real cluster for the hostile-input suites: a nats-server that requires a user and
password, the pool (master + store), one prefill and one decode worker (the default model,
one torch thread each) and a router with an API key, all real processes.

Starting the workers loads the model, so the cluster is started once for the package; each
test leaves it serving (that is what the tests assert) and uses its own request ids.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import nats
import pytest

from scripts.cluster import LocalCluster
from scripts.nats_server import NatsServer
from tests.router.conftest import router_env, router_port
from tests.router.e2e_cluster import wait_healthy

API_KEY = "sk-hostile-" + secrets.token_hex(8)
WORKER_ARGS = ["--num-threads", "1", "--kv-cache-mb", "64", "--transport", "tcp",
               "--handoff-timeout", "60"]  # fmt: skip
# runs first (pytest_collection_modifyitems): tests/hostile/test_transfer_ports.py
FLOOD_FIRST = "test_a_silent_flood_on_every_transfer_port_before_any_kv_moved"
# service id -> (service, extra flags)
PROCESSES = {
    "m1": ("cache_master", ["--replicas", "1"]),
    "s1": ("cache_store", ["--segment-size", "32MiB", "--transport", "tcp"]),
    "p1": ("prefill", WORKER_ARGS),
    "d1": ("decode", WORKER_ARGS),
    "router-h": ("router", ["--port", "0", "--api-key", API_KEY]),
}


@dataclass
class Hostile:
    nats: NatsServer
    cluster: LocalCluster
    url: str  # the router's base URL
    logs: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def dead(self) -> list[str]:
        """Labels of the cluster's processes that have exited."""
        return [label for label, p in self.cluster.procs.items() if p.poll() is not None]

    async def completion_works(self, prompt: str | list[int] = "The capital of France is") -> dict:
        """A valid greedy request through the router: every worker still serves."""
        body = {"model": "default", "prompt": prompt, "max_tokens": 2, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        async with aiohttp.ClientSession(headers=self.headers) as http:
            async with http.post(f"{self.url}/v1/completions", json=body) as r:
                out = await r.json()
                assert r.status == 200, out
        assert out["usage"]["completion_tokens"] == 2, out
        return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The transfer-port flood runs first of this package's tests: it must find the
    cluster before any KV has moved (no pooled transfer connections yet)."""
    slots = [i for i, item in enumerate(items) if "tests/hostile/" in item.nodeid]
    ours = [items[i] for i in slots]
    ours.sort(key=lambda item: not item.name.startswith(FLOOD_FIRST))  # stable
    for i, item in zip(slots, ours, strict=True):
        items[i] = item


@pytest.fixture(scope="package")
def hostile(tmp_path_factory) -> Iterator[Hostile]:
    workdir = tmp_path_factory.mktemp("hostile")
    server = NatsServer(workdir / "nats", user="tandem", password=secrets.token_urlsafe(16))
    server.start()
    cluster = LocalCluster(server.url, env=router_env(), capture=workdir / "logs")
    try:
        for sid, (service, args) in PROCESSES.items():
            cluster.start_one(service, "--service-id", sid, *args, label=sid)
        port = asyncio.run(router_port(server.url, "router-h", 240))
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_healthy(url, {"prefill": 1, "decode": 1}, 240, cluster.procs))
        yield Hostile(server, cluster, url, workdir / "logs")
    finally:
        cluster.stop()
        server.stop()


@pytest.fixture
async def nc(hostile: Hostile):
    """A plain NATS client of the hostile cluster's server (any bus client may send)."""
    client = await nats.connect(hostile.nats.url, connect_timeout=5, max_reconnect_attempts=3)
    try:
        yield client
    finally:
        await client.close()
