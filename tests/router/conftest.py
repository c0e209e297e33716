"""Fixtures for router tests: a module-wide nats-server and real router processes."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import nats
import pytest

from libs.common.engine.load.source import default_model_path, load_tokenizer
from libs.common.grammar.pool import GrammarPool
from libs.common.messages.control import InfoRequest, ServiceInfo
from scripts.cluster import LocalCluster
from scripts.nats_server import NatsServer


@pytest.fixture(scope="module")
def module_nats(tmp_path_factory) -> NatsServer:
    """One nats-server (JetStream on, free port) for all tests of a module."""
    server = NatsServer(tmp_path_factory.mktemp("nats")).start()
    try:
        yield server
    finally:
        server.stop()


def router_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["TANDEM_LOG_FORMAT"] = "json"
    return env


async def router_port(nats_url: str, service_id: str, timeout: float = 120.0) -> int:
    """Wait until router `service_id` answers `info`; return its HTTP port."""
    nc = await nats.connect(nats_url, connect_timeout=5, max_reconnect_attempts=3)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = await nc.request(
                    f"tandem.router.{service_id}.info", InfoRequest().encode(), timeout=1
                )
                return int(ServiceInfo.decode(msg.data).details["port"])
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(0.3)
        raise TimeoutError(f"router {service_id} not ready within {timeout}s")
    finally:
        await nc.close()


class Routers:
    """Router processes started by a test module, each stopped by its own pid."""

    def __init__(self, nats_url: str, logs: Path):
        self.nats_url, self.logs = nats_url, logs
        self.clusters: list[LocalCluster] = []

    def start(self, service_id: str, *args: str) -> str:
        """Start a router (sync: for module-scoped fixtures); return its base URL."""
        self._spawn(service_id, args)
        return f"http://127.0.0.1:{asyncio.run(router_port(self.nats_url, service_id))}"

    async def astart(self, service_id: str, *args: str) -> str:
        """`start` for async tests."""
        self._spawn(service_id, args)
        return f"http://127.0.0.1:{await router_port(self.nats_url, service_id)}"

    def _spawn(self, service_id: str, args: tuple[str, ...]) -> None:
        cluster = LocalCluster(self.nats_url, env=router_env(), capture=self.logs / service_id)
        self.clusters.append(cluster)
        cluster.start_one("router", "--service-id", service_id, "--port", "0", *args)

    def stop(self) -> None:
        for cluster in self.clusters:
            cluster.stop()
        self.clusters.clear()


@pytest.fixture(scope="session")
def grammar_pool() -> GrammarPool:
    """A grammar pool (libs/common/grammar/pool.py) of one worker process for the default
    model's tokenizer, as the router makes it."""
    tok, _, _ = load_tokenizer(default_model_path())
    pool = GrammarPool(tok.tokenizer.to_str(), tok.vocab_size, tok.eos_token_ids, workers=1)
    pool.start()
    try:
        yield pool
    finally:
        pool.close()
