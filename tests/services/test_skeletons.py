"""All five services as real processes on a real nats-server: discovery, info, clean stop."""

import subprocess
import sys

import aiohttp
import nats
import orjson
import pytest

from libs.common.messages.control import InfoRequest, ServiceInfo
from scripts.cluster import REPO, SERVICES, LocalCluster


@pytest.mark.parametrize("name", SERVICES)
def test_help_lists_every_flag_with_env_and_default(name):
    out = subprocess.run(
        [sys.executable, "-m", f"services.{name}", "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    text = " ".join(out.split())
    for flag in ("--nats-url", "--service-id", "--log-level", "--log-format", "--drain-timeout"):
        assert flag in text
    assert f"TANDEM_{name.upper()}_NATS_URL or TANDEM_NATS_URL" in text
    assert "default 'nats://127.0.0.1:4222'" in text


def test_service_without_nats_exits_1_naming_the_url(service_env):
    proc = subprocess.run(
        [sys.executable, "-m", "services.cache_master",
         "--nats-url", "nats://127.0.0.1:1", "--connect-timeout", "1"],
        cwd=REPO, env=service_env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "nats://127.0.0.1:1" in proc.stderr


async def test_five_services_register_answer_info_and_stop_with_exit_0(
    nats_url, service_env, tmp_path
):
    cluster = LocalCluster(
        nats_url,
        args={name: ["--service-id", f"{name.replace('_', '-')}-t"] for name in SERVICES}
        | {"router": ["--service-id", "router-t", "--port", "0"]},
        env=service_env,
        capture=tmp_path / "logs",
    )
    try:
        cluster.start()
        replies = await cluster.wait_ready(timeout=90)
        assert {f"tandem-{n}" for n in SERVICES} <= {r["name"] for r in replies}
        nc = await nats.connect(nats_url)
        try:
            for name in SERVICES:
                sid = f"{name.replace('_', '-')}-t"
                msg = await nc.request(
                    f"tandem.{name}.{sid}.info", InfoRequest().encode(), timeout=5
                )
                info = ServiceInfo.decode(msg.data)
                assert (info.service, info.service_id) == (name, sid)
                micro = orjson.loads(await _micro_info(nc, f"tandem-{name}"))
                assert any(e["name"] == "info" for e in micro["endpoints"])
                if name == "router":
                    url = f"http://127.0.0.1:{info.details['port']}/health"
                    async with aiohttp.ClientSession() as http, http.get(url) as resp:
                        assert resp.status == 200
                        assert (await resp.json())["status"] == "ok"
        finally:
            await nc.close()
    finally:
        codes = cluster.stop()
    assert codes == {name: 0 for name in SERVICES}, (tmp_path / "logs").iterdir()
    router_log = (tmp_path / "logs" / "router.log").read_text()
    first = orjson.loads(router_log.splitlines()[0])  # JSON lines, service fields bound
    assert first["service"] == "router" and first["service_id"] == "router-t"


async def _micro_info(nc, name: str) -> bytes:
    return (await nc.request(f"$SRV.INFO.{name}", b"", timeout=5)).data
