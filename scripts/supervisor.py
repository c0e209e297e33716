"""Restarts for `make run` (scripts/cluster.py): a service process that exits while the
stack runs is started again, as compose's `restart: unless-stopped` does, instead of
taking the whole stack down with it.

- Any exit restarts (a crash, a kill -9, or a cache master that stepped down and ended
  its own process so that a fresh standby takes its place: services/cache_master).
- After a backoff: `backoff` seconds, doubled for each exit in a row that came within
  `stable` seconds of its start, at most `max_backoff`. A process that ran `stable`
  seconds or more starts the count again.
- A process that exits `tries` times in a row within `stable` seconds of its start is
  given up, with a message saying so; the rest of the stack keeps running (Ctrl-C or
  SIGTERM still stops everything, and stops restarts).

Each decision is printed on stderr, one line, with the label and the exit code.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import IO


@dataclass(frozen=True)
class RestartPolicy:
    backoff: float = 1.0  # seconds before the first restart
    max_backoff: float = 30.0
    tries: int = 5  # exits in a row within `stable` s of the start before giving up
    stable: float = 30.0  # seconds of running that reset the count


class Supervisor:
    """Watches `procs` (label -> process, the launcher's own dict: a restart replaces the
    entry) and starts an exited one again with `start(label)`."""

    def __init__(
        self,
        procs: MutableMapping[str, subprocess.Popen],
        start: Callable[[str], subprocess.Popen],
        policy: RestartPolicy | None = None,
        out: IO[str] | None = None,
    ):
        self.procs, self.start, self.policy = procs, start, policy or RestartPolicy()
        self.out = out
        now = time.monotonic()
        self.started_at = {label: now for label in procs}
        self.exits: dict[str, int] = {}  # exits in a row within `stable` of the start
        self.due: dict[str, float] = {}  # label -> when it starts again
        self.given_up: set[str] = set()
        self.restarts = 0

    def _say(self, text: str) -> None:
        print(text, file=self.out or sys.stderr, flush=True)

    def poll(self) -> None:
        """Note exits, and start again what is due; call it every fraction of a second."""
        now = time.monotonic()
        for label, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None or label in self.due or label in self.given_up:
                continue
            ran = now - self.started_at.get(label, now)
            quick = self.exits.get(label, 0) + 1 if ran < self.policy.stable else 1
            self.exits[label] = quick
            if quick >= self.policy.tries:
                self.given_up.add(label)
                self._say(f"{label} exited with code {code}, {quick} times in a row within "
                          f"{self.policy.stable:g} s of its start: given up (see its log "
                          f"above); the rest keeps running, Ctrl-C stops everything")  # fmt: skip
                continue
            delay = min(self.policy.max_backoff, self.policy.backoff * 2 ** (quick - 1))
            self.due[label] = now + delay
            self._say(f"{label} exited with code {code} after {ran:.1f} s; restarting it in "
                      f"{delay:g} s (exit {quick} of {self.policy.tries} in a row before "
                      f"giving up)")  # fmt: skip
        for label, at in list(self.due.items()):
            if now >= at:
                del self.due[label]
                proc = self.start(label)
                self.started_at[label] = time.monotonic()
                self.restarts += 1
                self._say(f"{label} restarted (pid {proc.pid})")
