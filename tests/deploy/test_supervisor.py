"""`make run` restarts a service process that exits (scripts/supervisor.py), with real
processes: one killed with SIGKILL comes back with a new pid after its backoff, one that
exits at every start is given up after its tries with a message, and the others are left
alone. (The whole stack with a master killed: tests/deploy/test_make_run.py.)"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

from scripts.supervisor import RestartPolicy, Supervisor

LONG = [sys.executable, "-c", "import time; time.sleep(120)"]
CRASH = [sys.executable, "-c", "raise SystemExit(3)"]


def _until(supervisor: Supervisor, done, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "not within the time bound"
        supervisor.poll()
        time.sleep(0.02)


def test_a_killed_process_comes_back_and_one_that_keeps_crashing_is_given_up():
    commands = {"master": LONG, "other": LONG, "broken": CRASH}
    procs = {label: subprocess.Popen(cmd) for label, cmd in commands.items()}
    started: list[str] = []

    def start(label: str) -> subprocess.Popen:
        started.append(label)
        procs[label] = subprocess.Popen(commands[label])
        return procs[label]

    out = io.StringIO()
    supervisor = Supervisor(procs, start, RestartPolicy(backoff=0.05, tries=3), out=out)
    first, other = procs["master"].pid, procs["other"].pid
    try:
        os.kill(first, signal.SIGKILL)
        _until(supervisor, lambda: procs["master"].pid != first and "broken" in supervisor.given_up)
        assert procs["master"].poll() is None  # running again, a new process
        assert procs["other"].pid == other and procs["other"].poll() is None
        assert started.count("master") == 1 and started.count("broken") == 2
        text = out.getvalue()
        assert f"master exited with code {-signal.SIGKILL}" in text
        assert f"master restarted (pid {procs['master'].pid})" in text
        assert (
            "broken exited with code 3, 3 times in a row within 30 s of its start: given up" in text
        )
        supervisor.poll()  # given up: no more starts
        assert started.count("broken") == 2
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def test_the_backoff_doubles_for_each_quick_exit_in_a_row():
    procs = {"broken": subprocess.Popen(CRASH)}
    out = io.StringIO()

    def start(label: str) -> subprocess.Popen:
        procs[label] = subprocess.Popen(CRASH)
        return procs[label]

    supervisor = Supervisor(procs, start, RestartPolicy(backoff=0.1, tries=4), out=out)
    try:
        _until(supervisor, lambda: "broken" in supervisor.given_up)
    finally:
        procs["broken"].wait(timeout=10)
    delays = [line.split("restarting it in ")[1].split(" s")[0]
              for line in out.getvalue().splitlines() if "restarting it in" in line]  # fmt: skip
    assert delays == ["0.1", "0.2", "0.4"]
