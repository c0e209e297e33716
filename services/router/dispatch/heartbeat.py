"""This router's heartbeat: workers cancel the requests of a router that went silent.

    <prefix>.routers.<instance>.heartbeat   RouterHeartbeat, every --heartbeat-interval

`instance` is random at each start of the process (`new_instance_id`), so a restarted
router is a new instance: the requests of the old one are its own, and the workers drop
them --heartbeat-timeout after the old one's last heartbeat (a kill -9 sends no cancel).
The beat runs on the router's event loop: a loop blocked for longer than the timeout is
taken for a dead router too, one more reason nothing heavy runs on it (tokenization
runs in a thread, services/router/requests/prompts.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from libs.common.bus.connection import Bus
from libs.common.log import get_logger
from libs.common.messages.control import RouterHeartbeat

log = get_logger(__name__)


def new_instance_id() -> str:
    """16 random hex characters: unique per router process, safe in a NATS subject."""
    return uuid.uuid4().hex[:16]


class Heartbeat:
    """`start()` publishes at once and then every `interval`; `stop()` (safe twice) ends it."""

    def __init__(self, bus: Bus, prefix: str, beat: RouterHeartbeat):
        self.bus, self.beat = bus, beat
        self.subject = f"{prefix}.routers.{beat.router}.heartbeat"
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self._send()  # before the first request can go out
        self._task = asyncio.create_task(self._loop(), name="router-heartbeat")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self) -> None:
        interval = self.beat.interval
        while True:
            started = time.monotonic()
            await self._send()
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def _send(self) -> None:
        self.beat.timestamp = time.time()
        try:
            await self.bus.publish(self.subject, self.beat)
        except Exception as e:  # NATS down: the workers' deadline decides, not this beat
            log.debug("heartbeat not sent", error=str(e) or type(e).__name__)
