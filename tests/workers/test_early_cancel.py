"""A cancel that arrives before its request registered is remembered, once, and bounded."""

from __future__ import annotations

from libs.common.worker import held as worker
from libs.common.worker.held import HeldRequests
from libs.common.worker.router_watch import request_key
from libs.common.worker.service import WorkerService
from services.decode.config import DecodeConfig


def decode_held(service_id: str) -> HeldRequests:
    return WorkerService(DecodeConfig(service_id=service_id), "decode").core.held


async def test_cancel_before_the_request_registers_is_remembered_once_and_bounded():
    held = decode_held("d-early")
    await held.cancel("r1", "router gave up")
    assert held.was_cancelled("r1") and not held.was_cancelled("r1")
    assert not held.was_cancelled("never-cancelled")
    for i in range(worker._CANCELLED_KEPT + 10):
        await held.cancel(f"x{i}", "noise")
    assert len(held._cancelled) == worker._CANCELLED_KEPT
    assert not held.was_cancelled("x0") and held.was_cancelled(f"x{worker._CANCELLED_KEPT + 9}")


async def test_an_early_cancel_names_one_routers_request_only():
    held = decode_held("d-early-2")
    await held.cancel(request_key("aa", "same-id"), "router aa gave up")
    assert not held.was_cancelled(request_key("bb", "same-id"))
    assert not held.was_cancelled("same-id")
    assert held.was_cancelled(request_key("aa", "same-id"))
