"""Disaggregation over the shm transport: a prefill and a decode worker on one host move
KV through shared memory; output equals the engine's own, and each handoff's region
(registered per handoff, unregistered with its fence before the pages are freed) leaves
no slot behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from libs.common.bus.connection import Bus
from libs.common.messages.control import InfoRequest, ServiceInfo
from scripts.cluster import LocalCluster
from scripts.nats_server import NatsServer
from tests.workers.conftest import WORKER_ARGS, _wait_workers, generate, prompt_ids, reference

SHM_ARGS = [*WORKER_ARGS, "--transport", "shm", "--no-pool", "true"]


@pytest.fixture(scope="module")
def shm_cluster(tmp_path_factory, worker_env):
    workdir = tmp_path_factory.mktemp("shm-cluster")
    server = NatsServer(workdir / "nats").start()
    cluster = LocalCluster(server.url, env=worker_env, capture=workdir / "logs")
    try:
        cluster.start_one("prefill", "--service-id", "ps", *SHM_ARGS, label="ps")
        cluster.start_one("decode", "--service-id", "ds", *SHM_ARGS, label="ds")
        asyncio.run(_wait_workers(server.url, {"ps", "ds"}))
        yield server.url
    finally:
        cluster.stop()
        server.stop()


@pytest.fixture
async def shm_bus(shm_cluster) -> AsyncIterator[Bus]:
    bus = Bus(shm_cluster, "test-shm", 5, 30)
    await bus.connect()
    yield bus
    await bus.close()


async def test_disaggregated_over_shm_equals_the_engine_and_frees_every_handoff_region(shm_bus):
    prompts = [prompt_ids(9, seed=60), prompt_ids(70, seed=61), prompt_ids(150, seed=62)]
    expected = await reference(prompts, max_tokens=8)
    results = await asyncio.gather(
        *(generate(shm_bus, f"shm-{i}", p, decode="ds", prefill="ps", max_tokens=8)
          for i, p in enumerate(prompts))
    )  # fmt: skip
    assert [r.error for r in results] == [None] * 3
    assert [r.token_ids for r in results] == expected
    assert all(r.workers == ["ds", "ps"] for r in results)
    info = await shm_bus.request("tandem.decode.ds.info", InfoRequest(), ServiceInfo)
    assert info.details["transport"] == "shm" and info.details["transfer"]["transport"] == "shm"
    assert info.details["transfer"]["regions"] == 1  # the KV pool's own; handoffs' are gone
