"""A store's grant handler (services/cache_store/grants.py) on a real tcp engine: bad
requests are refused, a revocation never ends the segment's own registration."""

from __future__ import annotations

import pytest

from libs.common.bus.connection import HandlerError
from libs.common.messages.pool import PoolGrant
from libs.common.transfer import RegionDescriptor
from libs.common.transfer.tcp.engine import TcpTransferEngine
from services.cache_store.grants import serve_grant

SIZE = 1 << 16


@pytest.fixture
async def store():
    engine = TcpTransferEngine(host="127.0.0.1", port=0)
    await engine.start()
    try:
        yield engine, engine.register(engine.allocate(SIZE))
    finally:
        await engine.stop()


@pytest.mark.parametrize("req", [PoolGrant(1, "rw", [[0, 64]], 5.0),
                                 PoolGrant(1, "read", [[0, 64]], 0.0),
                                 PoolGrant(1, "read", [[0, 64]], 1e9),
                                 PoolGrant(1, "read", [[SIZE - 8, 64]], 5.0),
                                 PoolGrant(1, "write", [[0, 0]], 5.0),
                                 PoolGrant(1, "write", [[-1, 8]], 5.0),
                                 PoolGrant(1, "write", [[0]], 5.0)])  # fmt: skip
async def test_bad_grant_requests_are_refused(store, req):
    engine, segment = store
    with pytest.raises(HandlerError) as info:
        serve_grant(engine, segment, req, SIZE)
    assert info.value.code == 400


async def test_a_grant_is_its_own_region_and_a_revocation_spares_the_segment(store):
    engine, segment = store
    reply = serve_grant(engine, segment, PoolGrant(1, "read", [[0, 64]], 5.0), SIZE)
    grant = RegionDescriptor.from_dict(reply.descriptor)
    assert grant.region_id != segment.region_id and grant.token != segment.token
    before = engine.info()["regions"]
    both = PoolGrant(1, revoke=[grant.region_id, segment.region_id])
    reply = serve_grant(engine, segment, both, SIZE)
    assert reply.revoked == 1 and engine.info()["regions"] == before - 1
