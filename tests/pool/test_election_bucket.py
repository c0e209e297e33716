"""The masters' JetStream bucket (leader key, saved pins) has a size bound (issue 39).

A real nats-server; one elected master in this process (so that its pin endpoint can be
called with a pin larger than one NATS message could carry). The bucket it makes holds at
most `--election-bucket-bytes` and MAX_VALUE per value, one history entry per key: a
writer that fills it is refused by JetStream, and the master refuses a value above the
bound itself, before sending it.
"""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.js.errors import APIError

from libs.common.bus.connection import HandlerError
from libs.common.bus.permissions import election_bucket
from libs.common.messages.pins import PoolPin, PoolPinList
from services.cache_master.config import CacheMasterConfig
from services.cache_master.ha.election import KEY, MAX_CLAIM, MAX_VALUE, Claim
from services.cache_master.service import CacheMasterService

BUCKET_BYTES = 2 << 20


@pytest.fixture
async def leader(nats_url):
    config = CacheMasterConfig.parse(["--nats-url", nats_url, "--service-id", "bounded",
                                      "--election-bucket-bytes", str(BUCKET_BYTES)])  # fmt: skip
    master = CacheMasterService(config)
    await master.start()
    try:
        for _ in range(100):  # the first master claims the empty key at once
            if master.role == "leader":
                break
            await asyncio.sleep(0.05)
        assert master.role == "leader"
        yield master
    finally:
        await master.stop()


async def test_the_bucket_is_made_with_its_bounds_and_refuses_to_grow_past_them(leader, nats_url):
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream(timeout=5)
        config = (await js.stream_info(f"KV_{election_bucket('tandem')}")).config
        assert (config.max_bytes, config.max_msg_size) == (BUCKET_BYTES, MAX_VALUE)
        assert config.max_msgs_per_subject == 1
        kv = await js.key_value(election_bucket("tandem"))
        value = b"x" * (900 << 10)
        await kv.put("pin.filler-1", value)  # fits: 0.9 MiB of 2 MiB
        await kv.put("pin.filler-2", value)  # fits: 1.8 MiB
        with pytest.raises(APIError, match="maximum bytes"):
            await kv.put("pin.filler-3", value)  # 2.7 MiB: refused, the bucket stays bounded
        assert (await kv.get(KEY)).value is not None  # the leader key is untouched
    finally:
        await nc.close()
    await asyncio.sleep(0.5)  # two renewals: the leader still renews within the bound
    assert leader.role == "leader"


async def test_the_master_refuses_a_pin_above_the_value_bound_and_keeps_none_of_it(leader):
    keys = [f"{i:08d}" + "k" * 200 for i in range(6000)]  # ~1.25 MB as a saved record
    with pytest.raises(HandlerError) as refused:
        await leader.pinning.pin(PoolPin(keys, 60.0))
    assert refused.value.code == 413 and f"{MAX_VALUE} bytes per value" in refused.value.message
    assert (await leader.pinning.pins(PoolPinList())).pins == []
    small = await leader.pinning.pin(PoolPin(keys[:100], 60.0))  # within the bound: saved
    assert small.pages == 100


def test_a_leader_value_above_a_claim_s_size_is_not_a_claim():
    big = Claim("m" * MAX_CLAIM, 7).encode()
    assert len(big) > MAX_CLAIM
    assert Claim.decode(big) == Claim("", 0)
    assert Claim.decode(Claim("m", 7).encode()) == Claim("m", 7)
