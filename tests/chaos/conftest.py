"""One real cluster (see harness.py) for the fault tests of this package that ask for it.

`chaos_cluster` is started once, on first use; `chaos` hands it to a test after waiting
until it is whole again: a test that kills a process restarts it before it ends, and the
next one does not depend on the order they run in. Tests that build their own processes
(test_link_cut.py) never start it.
"""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest

from tests.chaos.harness import ChaosCluster
from tests.chaos.reports import connect


@pytest.fixture(scope="package")
def chaos_cluster(tmp_path_factory) -> Iterator[ChaosCluster]:
    cluster = ChaosCluster(tmp_path_factory.mktemp("chaos"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
async def chaos(chaos_cluster: ChaosCluster) -> ChaosCluster:
    await chaos_cluster.wait_whole(timeout=120)
    return chaos_cluster


@pytest.fixture
async def bus(chaos):
    b = await connect(chaos.nats_url, "chaos-test")
    yield b
    await b.close()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session
