"""A cancel that arrives before its request registered is remembered, once, and bounded."""

from __future__ import annotations

from libs.common.worker import core as worker
from libs.common.worker.router_watch import request_key
from libs.common.worker.service import WorkerService
from services.decode.config import DecodeConfig


def decode_core(service_id: str) -> worker.WorkerCore:
    return WorkerService(DecodeConfig(service_id=service_id), "decode").core


async def test_cancel_before_the_request_registers_is_remembered_once_and_bounded():
    core = decode_core("d-early")
    await core.cancel("r1", "router gave up")
    assert core.was_cancelled("r1") and not core.was_cancelled("r1")
    assert not core.was_cancelled("never-cancelled")
    for i in range(worker._CANCELLED_KEPT + 10):
        await core.cancel(f"x{i}", "noise")
    assert len(core._cancelled) == worker._CANCELLED_KEPT
    assert not core.was_cancelled("x0") and core.was_cancelled(f"x{worker._CANCELLED_KEPT + 9}")


async def test_an_early_cancel_names_one_routers_request_only():
    core = decode_core("d-early-2")
    await core.cancel(request_key("aa", "same-id"), "router aa gave up")
    assert not core.was_cancelled(request_key("bb", "same-id"))
    assert not core.was_cancelled("same-id")
    assert core.was_cancelled(request_key("aa", "same-id"))
