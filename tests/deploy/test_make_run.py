"""`make run` (scripts/cluster.py) serves with one NATS identity per process.

The real launcher as a subprocess, in its own run folder and ports, with `--routers 2`:
every service gets a credentials file bound to its service id, nats-server loads their
permissions, and a chat completion goes through router and decode (and through router-2,
the same answer), a long one through prefill too; their pages
then reach the pool (the master's stats, asked as the operator's read-only identity,
count them); no service hears a permissions violation. No process is started with a
password on its command line, nats-server's monitoring is off, a master killed with
SIGKILL is started again while the stack keeps serving, and Ctrl-C (SIGTERM) stops
everything with exit code 0.
Tens of seconds on a busy 2-core host (two model loads).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from libs.common.bus.credentials import connect_options
from scripts.cluster import REPO

UP = re.compile(r"Tandem is up: router at (http://127\.0\.0\.1:\d+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_ports(n: int) -> int:
    """The first of `n` consecutive ports free now (the launcher's routers take them)."""
    for _ in range(50):
        first = _free_port()
        with contextlib.ExitStack() as held:
            try:
                for k in range(n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", first + k))
            except OSError:
                continue
        return first
    raise RuntimeError(f"no {n} consecutive free ports")


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of every process whose parent is `pid` (Linux /proc)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().split()[3]) == pid:
                found[int(proc.name)] = (
                    (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                )
        except (OSError, IndexError, ValueError):
            continue
    return found


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


async def _pool_objects_seen_by_the_operator(url: str, credentials: Path) -> int:
    """The master's object count, asked as the read-only cli identity, once the finished
    request's pages reached the pool (workers' puts under their own identities)."""
    import nats

    nc = await nats.connect(url, connect_timeout=5, **connect_options(url, str(credentials)))
    try:
        for _ in range(40):
            try:
                reply = await nc.request("tandem.pool.master.stats", b"{}", timeout=5)
            except nats.errors.NoRespondersError:  # between leaders: nobody serves yet
                await asyncio.sleep(0.25)
                continue
            objects = json.loads(reply.data)["objects"]
            if objects:
                return objects
            await asyncio.sleep(0.25)
        return 0
    finally:
        await nc.close()


def test_make_run_serves_a_chat_completion_with_an_identity_per_service(tmp_path, service_env):
    env = {**service_env, "TANDEM_PREFILL_KV_CACHE_MB": "64", "TANDEM_DECODE_KV_CACHE_MB": "64"}
    env.pop("NATS_MONITOR_PORT", None)
    nats_port = _free_port()
    cmd = [sys.executable, "-m", "scripts.cluster", "--run-dir", str(tmp_path / "run"),
           "--nats-port", str(nats_port), "--router-port", str(_free_ports(2)),
           "--routers", "2", "--ready-timeout", "300"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))
    reader.start()
    try:
        deadline = time.monotonic() + 330
        while not any(UP.search(line) for line in lines):
            assert proc.poll() is None, "".join(lines[-40:])
            assert time.monotonic() < deadline, "".join(lines[-40:])
            time.sleep(0.5)
        base = next(m.group(1) for line in lines if (m := UP.search(line)))
        secrets = tmp_path / "run" / "secrets"
        passwords = [f.read_text().split(":", 1)[1].strip() for f in secrets.glob("*.credentials")]
        assert len(passwords) == 9  # eight processes (two masters, two routers), the operator
        for cmdline in _children(proc.pid).values():
            assert not any(p in cmdline for p in passwords), cmdline
        assert "monitoring" not in next(line for line in lines if UP.search(line))
        body = {"model": "default", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "Say hello."}]}  # fmt: skip
        answer = _post(f"{base}/v1/chat/completions", body, timeout=120)
        assert answer["choices"][0]["message"]["content"]
        assert answer["usage"]["completion_tokens"] > 0
        # router-2 on the next port, with its own identity: the same answer (greedy) as
        # router-1 gives now. Both find the prompt's pages cached and compute its last
        # token alone, where the first request computed all 33 in one chunk: a row's bits
        # depend on its row class (docs/engine.md, "Which kernel runs where"), and this
        # prompt has a near-tie at its second token, so cold and cached may differ there.
        host, port = base.rsplit(":", 1)
        again = _post(f"{base}/v1/chat/completions", body, timeout=120)
        second = _post(f"{host}:{int(port) + 1}/v1/chat/completions", body, timeout=120)
        for reply in (again, second):
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert second["choices"][0]["message"] == again["choices"][0]["message"]
        # kill -9 of a master: the launcher starts it again (scripts/supervisor.py) and the
        # stack keeps serving, the pool included (a standby leads, or master-1 again).
        (old,) = [pid for pid, cmd in _children(proc.pid).items() if "master-1" in cmd]
        os.kill(old, signal.SIGKILL)
        back = re.compile(r"cache_master restarted \(pid (\d+)\)")
        while not any(back.search(line) for line in lines):
            assert proc.poll() is None, "".join(lines[-40:])
            assert time.monotonic() < deadline + 60, "".join(lines[-40:])
            time.sleep(0.2)
        new = int(next(m.group(1) for line in lines if (m := back.search(line))))
        assert new != old and "master-1" in _children(proc.pid)[new]
        # Past --disagg-threshold (128 tokens): the prefill worker computes it and hands
        # the KV over (generate, prefill, token 0 on the router's stream, each identity's).
        long = "Tell me about the history of each of these cities. " + "Paris, Rome, Oslo. " * 40
        body["messages"] = [{"role": "user", "content": long}]
        assert _post(f"{base}/v1/chat/completions", body, timeout=120)["choices"][0]["message"]
        assert any(line.startswith("prefill") and "prefill done" in line for line in lines)
        url, cli = f"nats://127.0.0.1:{nats_port}", secrets / "cli.credentials"
        # The leader after the kill starts with no metadata; the stores mount on it at their
        # next heartbeat, and a put before that is refused: ask again, a bounded while.
        for attempt in range(10):
            if asyncio.run(_pool_objects_seen_by_the_operator(url, cli)) > 0:
                break
            assert time.monotonic() < deadline + 180, "".join(lines[-40:])
            body["messages"] = [{"role": "user", "content": f"{attempt} {long}"}]
            _post(f"{base}/v1/chat/completions", body, timeout=120)
            time.sleep(1.0)
        assert asyncio.run(_pool_objects_seen_by_the_operator(url, cli)) > 0
        assert not [line for line in lines if "permissions violation" in line.lower()]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        reader.join(timeout=10)
    assert code == 0, "".join(lines[-40:])


def test_make_run_refuses_to_start_on_a_damaged_credentials_file(tmp_path, service_env):
    secrets = tmp_path / "run" / "secrets"
    secrets.mkdir(parents=True)
    (secrets / "router.credentials").write_text("no-colon-here\n")
    cmd = [sys.executable, "-m", "scripts.cluster", "--run-dir", str(tmp_path / "run"),
           "--nats-port", str(_free_port())]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=service_env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 1
    assert "router.credentials: expected one line `user:password`" in done.stderr
    assert not (tmp_path / "run" / "nats").exists()  # nothing was started
