"""The router's heartbeat from a process of its own: a stalled router is not a dead one.

    python -m services.router.dispatch.beat_process     (started by heartbeat.py only)

Its stdin is a pipe from the router. The first line is its settings (JSON, `Settings`:
the NATS URL and credentials file, never in argv; the subject and the `RouterHeartbeat`);
after it the router writes one byte per heartbeat interval from its event loop: a *tick*.
This process publishes the beat every `interval` while

- the router lives: stdin at end of file (the router exited, kill -9 included: the kernel
  closes the pipe) or a new parent pid (the router died, this process was adopted) ends it
  at once, so a router dead for good has its requests freed `timeout` later, as before;
- and its loop ticked within `max_stall` seconds: a loop blocked that long is taken for
  hung, and the beat pauses (it resumes with the ticks).

A loop blocked for less (a slow request, a GC pause, SIGSTOP of the router process alone)
no longer silences the router: a thread would not do, since code that holds the GIL (a
backtracking regular expression) stops every thread of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from dataclasses import asdict, dataclass

import orjson

from libs.common.bus.connection import Bus, BusError
from libs.common.log import get_logger, setup_logging
from libs.common.messages.control import RouterHeartbeat

log = get_logger(__name__)


@dataclass
class Settings:
    """What the router passes on the first line of stdin."""

    nats_url: str
    credentials_file: str  # an absolute path, or ""
    name: str  # the NATS connection's name
    subject: str
    beat: dict  # a RouterHeartbeat, as `to_dict()` gives it
    max_stall: float
    log_level: str = "info"
    log_format: str = "auto"

    def line(self) -> bytes:
        return orjson.dumps(asdict(self)) + b"\n"


class Beater:
    """Publishes `beat` every interval while the router lives and its loop ticks."""

    def __init__(self, settings: Settings, fd: int):
        self.settings, self.fd = settings, fd
        self.beat = RouterHeartbeat.decode(orjson.dumps(settings.beat))
        self.ticked = time.monotonic()
        self.ended = asyncio.Event()
        self.parent = os.getppid()

    def _on_stdin(self) -> None:
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return
        if not data:
            self.ended.set()  # the router exited: its end of the pipe is closed
        else:
            self.ticked = time.monotonic()

    async def run(self) -> None:
        s = self.settings
        bus = Bus(s.nats_url, s.name, connect_timeout=30.0, request_timeout=2.0,
                  credentials_file=s.credentials_file)  # fmt: skip
        await bus.connect()
        loop = asyncio.get_running_loop()
        os.set_blocking(self.fd, False)
        loop.add_reader(self.fd, self._on_stdin)
        hung = False
        try:
            while not self.ended.is_set() and os.getppid() == self.parent:
                stalled = time.monotonic() - self.ticked
                if stalled <= s.max_stall:
                    hung = False
                    await self._send(bus)
                elif not hung:
                    hung = True
                    log.warning("router loop hung; heartbeat paused", stalled_s=round(stalled, 1))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.ended.wait(), self.beat.interval)
        finally:
            loop.remove_reader(self.fd)
            await bus.close()

    async def _send(self, bus: Bus) -> None:
        self.beat.timestamp = time.time()
        try:
            await bus.publish(self.settings.subject, self.beat)
        except Exception as e:  # NATS down: the workers' deadline decides, not this beat
            log.debug("heartbeat not sent", error=str(e) or type(e).__name__)


def main() -> None:
    line = sys.stdin.buffer.readline()
    if not line:  # the router is gone already
        return
    settings = Settings(**orjson.loads(line))
    setup_logging(settings.log_level, settings.log_format, service="router-heartbeat")
    try:
        asyncio.run(Beater(settings, sys.stdin.fileno()).run())
    except BusError as e:  # the router beats from its loop; it starts us again later
        log.warning("heartbeat process could not connect", error=str(e))
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C of `make run` reaches us too
        pass


if __name__ == "__main__":
    main()
