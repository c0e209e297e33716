"""The router's beat process (services/router/dispatch/beat_process.py), run in this test's
loop against a real nats-server: it beats while the router's loop ticks, pauses when the
ticks stop for --heartbeat-max-stall (a hung router frees its work), resumes with them,
and ends when the router's end of the pipe closes (the router exited)."""

from __future__ import annotations

import asyncio
import os
import time

import nats

from libs.common.bus.connection import settle
from libs.common.messages.control import RouterHeartbeat
from services.router.dispatch.beat_process import Beater, Settings

SUBJECT = "tandem.routers.beatproc0.heartbeat"


async def test_beats_pause_after_max_stall_without_ticks_resume_and_end_with_the_pipe(
    module_nats,
):
    beat = RouterHeartbeat(router="beatproc0", service_id="t", interval=0.1, timeout=1.0,
                           timestamp=0.0)  # fmt: skip
    settings = Settings(module_nats.url, "", "test-beat", SUBJECT, beat.to_dict(), 0.5)
    heard: list[float] = []
    new_beat = asyncio.Event()

    async def on_beat(msg) -> None:
        assert RouterHeartbeat.decode(msg.data).router == "beatproc0"
        heard.append(time.monotonic())
        new_beat.set()

    nc = await nats.connect(module_nats.url)
    read_end, write_end = os.pipe()
    try:
        await nc.subscribe(SUBJECT, cb=on_beat)
        await settle(nc)  # the beater publishes on its own connection
        task = asyncio.create_task(Beater(settings, read_end).run())
        os.write(write_end, b".")
        await asyncio.wait_for(new_beat.wait(), 30)  # connected and beating
        last_tick = time.monotonic()
        await asyncio.sleep(2.0)  # no tick for 2 s: 4 x max_stall
        late = [t for t in heard if t > last_tick + 1.0]
        assert late == [], f"{len(late)} beats more than 1 s after the last tick"
        new_beat.clear()
        os.write(write_end, b".")  # the loop runs again
        await asyncio.wait_for(new_beat.wait(), 2)
        os.close(write_end)  # the router exited
        write_end = -1
        await asyncio.wait_for(task, 5)
    finally:
        if write_end >= 0:
            os.close(write_end)
        os.close(read_end)
        await nc.close()
