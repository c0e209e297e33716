"""This router's heartbeat: workers cancel the requests of a router that went silent.

    <prefix>.routers.<instance>.heartbeat   RouterHeartbeat, every --heartbeat-interval

`instance` is random at each start of the process (`new_instance_id`), so a restarted
router is a new instance: the requests of the old one are its own, and the workers drop
them --heartbeat-timeout after the old one's last heartbeat (a kill -9 sends no cancel).

Two senders publish the same beat. The event loop's (here) covers the first moments and a
beat process that died. The beat process (beat_process.py, --heartbeat-max-stall > 0)
goes on while the loop is blocked: a stalled router is not a dead one, its in-flight
requests survive a stall of up to --heartbeat-max-stall on the workers. The loop ticks it
every interval; it stops at once when the router exits (its stdin closes) and pauses when
the loop has not ticked for --heartbeat-max-stall (a hung router frees its work too).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import subprocess
import sys
import time
import uuid

from libs.common.bus.connection import Bus
from libs.common.log import get_logger
from libs.common.messages.control import RouterHeartbeat
from services.router.dispatch.beat_process import Settings

log = get_logger(__name__)

_ROOT = pathlib.Path(__file__).resolve().parents[3]  # where `services` is importable from
_RESPAWN_S = 10.0  # a beat process that exited is started again at most this often
_EXIT_WAIT_S = 2.0  # stop(): how long the beat process has to exit before it is killed


def new_instance_id() -> str:
    """16 random hex characters: unique per router process, safe in a NATS subject."""
    return uuid.uuid4().hex[:16]


class Heartbeat:
    """`start()` publishes at once and then every `interval`; `stop()` (safe twice) ends it.
    With `max_stall` > 0, a beat process publishes too (see the module's text)."""

    def __init__(self, bus: Bus, prefix: str, beat: RouterHeartbeat, max_stall: float = 0.0,
                 log_level: str = "info", log_format: str = "auto"):  # fmt: skip
        self.bus, self.beat = bus, beat
        self.subject = f"{prefix}.routers.{beat.router}.heartbeat"
        self._task: asyncio.Task | None = None
        self.settings: Settings | None = None  # no beat process with max_stall 0
        if max_stall > 0:
            creds = os.path.abspath(bus.credentials_file) if bus.credentials_file else ""
            self.settings = Settings(bus.url, creds, f"{bus.name}-heartbeat", self.subject,
                                     beat.to_dict(), max_stall, log_level, log_format)  # fmt: skip
        self.proc: subprocess.Popen | None = None
        self._spawned_at = -_RESPAWN_S

    async def start(self) -> None:
        await self._send()  # before the first request can go out
        self._spawn()
        self._task = asyncio.create_task(self._loop(), name="router-heartbeat")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        proc, self.proc = self.proc, None
        if proc is not None:
            await _end(proc)

    async def _loop(self) -> None:
        interval = self.beat.interval
        while True:
            started = time.monotonic()
            await self._send()
            self._tick()
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def _send(self) -> None:
        self.beat.timestamp = time.time()
        try:
            await self.bus.publish(self.subject, self.beat)
        except Exception as e:  # NATS down: the workers' deadline decides, not this beat
            log.debug("heartbeat not sent", error=str(e) or type(e).__name__)

    def _spawn(self) -> None:
        if self.settings is None:
            return
        self._spawned_at = time.monotonic()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(_ROOT), os.environ.get("PYTHONPATH", "")) if p)}  # fmt: skip
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.router.dispatch.beat_process"],
                stdin=subprocess.PIPE,
                env=env,
            )
            if proc.stdin is not None:  # always, with stdin=PIPE
                proc.stdin.write(self.settings.line())
                proc.stdin.flush()
                os.set_blocking(proc.stdin.fileno(), False)
        except OSError as e:
            log.warning("heartbeat process not started; beating from the loop only", error=str(e))
            return
        self.proc = proc

    def _tick(self) -> None:
        """Tell the beat process this loop runs; start it again if it exited."""
        proc = self.proc
        if proc is not None and proc.poll() is None and proc.stdin is not None:
            try:
                os.write(proc.stdin.fileno(), b".")
                return
            except BlockingIOError:  # a full pipe: the process is alive, only behind
                return
            except OSError:  # it is exiting
                pass
        if self.settings is None or time.monotonic() - self._spawned_at < _RESPAWN_S:
            return
        self.proc = None
        if proc is not None:
            log.warning("heartbeat process exited; starting it again", code=proc.poll())
            _close_stdin(proc)
        self._spawn()


def _close_stdin(proc: subprocess.Popen) -> None:
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()


async def _end(proc: subprocess.Popen) -> None:
    """Close the beat process's stdin (it exits at once), wait a little, then kill it."""
    _close_stdin(proc)
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(None, proc.wait, _EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        await loop.run_in_executor(None, proc.wait)
