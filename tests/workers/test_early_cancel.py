"""A cancel that arrives before its request registered is remembered, once, and bounded."""

from __future__ import annotations

from libs.common.worker import core as worker
from libs.common.worker.decode import DecodeService
from libs.common.worker.router_watch import request_key
from services.decode.config import DecodeConfig


async def test_cancel_before_the_request_registers_is_remembered_once_and_bounded():
    svc = DecodeService(DecodeConfig(service_id="d-early"))
    await svc.cancel("r1", "router gave up")
    assert svc.was_cancelled("r1") and not svc.was_cancelled("r1")
    assert not svc.was_cancelled("never-cancelled")
    for i in range(worker._CANCELLED_KEPT + 10):
        await svc.cancel(f"x{i}", "noise")
    assert len(svc._cancelled) == worker._CANCELLED_KEPT
    assert not svc.was_cancelled("x0") and svc.was_cancelled(f"x{worker._CANCELLED_KEPT + 9}")


async def test_an_early_cancel_names_one_routers_request_only():
    svc = DecodeService(DecodeConfig(service_id="d-early-2"))
    await svc.cancel(request_key("aa", "same-id"), "router aa gave up")
    assert not svc.was_cancelled(request_key("bb", "same-id"))
    assert not svc.was_cancelled("same-id")
    assert svc.was_cancelled(request_key("aa", "same-id"))
