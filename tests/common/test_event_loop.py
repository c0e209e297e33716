"""The event loop choice: uvloop by default (a base requirement), asyncio on request."""

from __future__ import annotations

import asyncio

import pytest

from libs.common import event_loop
from libs.common.config import CommonConfig


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_is_the_default_and_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_EVENT_LOOP", raising=False)
    assert event_loop.loop_name() == "uvloop"
    assert event_loop.run(_loop_module()).startswith("uvloop")


def test_asyncio_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    assert event_loop.run(_loop_module(), "asyncio").startswith("asyncio")
    monkeypatch.setenv("TANDEM_EVENT_LOOP", "asyncio")
    assert event_loop.loop_name() == "asyncio"
    assert event_loop.run(_loop_module()).startswith("asyncio")
    assert event_loop.loop_name("uvloop") == "uvloop"  # an explicit choice wins


def test_services_take_the_flag_and_refuse_others() -> None:
    assert CommonConfig.parse(["--event-loop", "asyncio"]).event_loop == "asyncio"
    assert CommonConfig.parse([]).event_loop == "uvloop"
    with pytest.raises(SystemExit):
        CommonConfig.parse(["--event-loop", "trio"])


def test_a_service_process_says_which_loop_it_runs(nats_url: str) -> None:
    import subprocess
    import sys

    import orjson

    for requested in ("uvloop", "asyncio"):
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cache_master", "--nats-url", nats_url,
             "--log-format", "json", "--event-loop", requested],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            events = {}
            for _ in range(50):  # "event loop" comes first, then NATS, then "service started"
                line = orjson.loads(proc.stdout.readline())
                events[line["event"]] = line
                if line["event"] == "service started":
                    break
            assert events["event loop"]["event_loop"] == requested
        finally:
            proc.terminate()
            assert proc.wait(timeout=30) == 0
