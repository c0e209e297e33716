"""NATS with credentials, as `make run` and the hostile cluster start it: clients without the
password are refused, and the password appears in no command line, log or info reply."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import nats
import pytest

from libs.common.messages.control import InfoRequest, ServiceInfo
from scripts.nats_server import NatsServer
from tests.hostile.conftest import PROCESSES, Hostile


def _text(path: Path | str) -> str:
    return Path(path).read_text()


async def test_nats_refuses_clients_without_the_password(tmp_path):
    server = NatsServer(tmp_path / "nats", user="tandem", password="s3cret-pw").start()
    try:
        assert "s3cret-pw" not in _text(f"/proc/{server.proc.pid}/cmdline")
        assert stat.S_IMODE(os.stat(tmp_path / "nats" / "auth.conf").st_mode) == 0o600
        assert server.redacted_url == f"nats://tandem:***@127.0.0.1:{server.port}"
        bare = f"nats://127.0.0.1:{server.port}"
        wrong = f"nats://tandem:nope@127.0.0.1:{server.port}"
        for url in (bare, wrong):
            with pytest.raises((nats.errors.Error, OSError)):
                await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0,
                                   allow_reconnect=False)  # fmt: skip
        nc = await nats.connect(server.url, connect_timeout=5)
        await nc.close()
    finally:
        server.stop()


def test_credentials_must_be_given_whole_and_url_safe(tmp_path):
    with pytest.raises(ValueError, match="both"):
        NatsServer(tmp_path, user="tandem")
    with pytest.raises(ValueError, match="URL-safe"):
        NatsServer(tmp_path, user="tandem", password="a@b:c")


@pytest.mark.slow
async def test_services_keep_the_nats_password_out_of_argv_logs_and_info(hostile: Hostile):
    password = hostile.nats.password
    for label, proc in hostile.cluster.procs.items():
        assert password not in _text(f"/proc/{proc.pid}/cmdline"), label
        assert password not in _text(hostile.logs / f"{label}.log"), label
    nc = await nats.connect(hostile.nats.url, connect_timeout=5)
    try:
        for sid, (service, _) in PROCESSES.items():
            msg = await nc.request(f"tandem.{service}.{sid}.info", InfoRequest().encode(), 10)
            info = ServiceInfo.decode(msg.data)
            assert password not in msg.data.decode() and "***" in info.nats_url, sid
    finally:
        await nc.close()
