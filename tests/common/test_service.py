"""Service lifecycle: in-flight work drains on stop, stop is idempotent and safe half-started."""

import asyncio
import time

from libs.common.bus.connection import Endpoint
from libs.common.config import CommonConfig
from libs.common.messages.control import InfoRequest, Message, ServiceInfo
from libs.common.service import BaseService


class Slow(Message, tag="test_slow"):
    seconds: float


class SlowService(BaseService):
    def endpoints(self) -> list[Endpoint]:
        async def handle(req: Slow) -> Slow:
            await asyncio.sleep(req.seconds)
            return req

        return [Endpoint("slow", "t.slow", Slow, handle, concurrent=True)]


def _config(url: str, drain: float = 5.0) -> CommonConfig:
    return CommonConfig(nats_url=url, service_id="svc-1", drain_timeout=drain)


async def test_stop_lets_in_flight_request_finish_within_drain_timeout(nats_url):
    service, client = SlowService(_config(nats_url)), SlowService(_config(nats_url))
    await service.start()
    await client.bus.connect()
    try:
        pending = asyncio.create_task(client.bus.request("t.slow", Slow(seconds=0.5), Slow))
        await asyncio.sleep(0.2)
        await service.stop()
        assert (await pending).seconds == 0.5
    finally:
        await client.bus.close()


async def test_drain_timeout_bounds_stop(nats_url):
    service, client = SlowService(_config(nats_url, drain=0.3)), SlowService(_config(nats_url))
    await service.start()
    await client.bus.connect()
    try:
        pending = asyncio.create_task(client.bus.request("t.slow", Slow(seconds=30), Slow))
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        await service.stop()
        assert time.monotonic() - t0 < 3
        pending.cancel()
    finally:
        await client.bus.close()


async def test_stop_twice_and_before_start_is_safe(nats_url):
    never_started = SlowService(_config(nats_url))
    await never_started.stop()
    await never_started.stop()
    service = SlowService(_config(nats_url))
    await service.start()
    await asyncio.gather(service.stop(), service.stop())
    await service.stop()


async def test_info_endpoint_answers_with_identity(nats_url):
    service, client = SlowService(_config(nats_url)), SlowService(_config(nats_url))
    await service.start()
    await client.bus.connect()
    try:
        info = await client.bus.request("tandem.common.svc-1.info", InfoRequest(), ServiceInfo)
        assert info.service_id == "svc-1" and info.nats_url == nats_url
    finally:
        await client.bus.close()
        await service.stop()
