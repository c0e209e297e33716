"""One real cluster for the whole chaos package (see harness.py).

A test that kills a process restarts it before it ends; the next test first waits until
the cluster is whole again (`whole`), so tests do not depend on their order.
"""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest

from tests.chaos.harness import ChaosCluster, connect


@pytest.fixture(scope="package")
def chaos(tmp_path_factory) -> Iterator[ChaosCluster]:
    cluster = ChaosCluster(tmp_path_factory.mktemp("chaos"))
    try:
        cluster.want = cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
async def whole(chaos: ChaosCluster) -> None:
    await chaos.wait_whole(timeout=120)


@pytest.fixture
async def bus(chaos, whole):
    b = await connect(chaos.nats_url, "chaos-test")
    yield b
    await b.close()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session
