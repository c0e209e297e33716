"""A decode worker killed (-9) mid-stream with no other decode worker live: the client's
stream ends with an error, soon.

Real processes: nats-server, one prefill and one decode worker, the router. The decode
worker dies without a word; the router notices its load reports stop (3 s), finds no other
decode worker to continue the request on (migration, tests/chaos/test_migration.py) and
ends the stream with an OpenAI-shaped error event, then `[DONE]`: no client is left hanging.
"""

import os
import signal
import time

import aiohttp
import orjson
import pytest

from scripts.cluster import LocalCluster
from tests.router.conftest import router_env, router_port
from tests.router.e2e_cluster import WORKER_ARGS, wait_healthy


@pytest.mark.slow
async def test_the_lone_decode_worker_killed_mid_stream_ends_the_stream_with_an_error(
    nats_url, tmp_path
):
    cluster = LocalCluster(nats_url, env=router_env(), capture=tmp_path / "logs")
    try:
        for role, sid in (("prefill", "p1"), ("decode", "d1")):
            cluster.start_one(role, "--service-id", sid, *WORKER_ARGS, label=sid)
        cluster.start_one("router", "--service-id", "router-kill", "--port", "0")
        port = await router_port(nats_url, "router-kill", 240)
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url, {"prefill": 1, "decode": 1}, 240, cluster.procs)
        body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 400,
                "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
        events: list[str] = []
        killed_at = 0.0
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http,
            http.post(f"{url}/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 5:  # streaming for real: now kill the decode worker
                    os.kill(cluster.procs["d1"].pid, signal.SIGKILL)
                    killed_at = time.monotonic()
                if line == "data: [DONE]":
                    break
        ended_after = time.monotonic() - killed_at
    finally:
        cluster.stop()
    assert killed_at and events[-1] == "[DONE]"
    error = orjson.loads(events[-2])
    assert "error" in error and "d1" in error["error"]["message"]
    assert ended_after < 8, f"stream ended {ended_after:.1f}s after the kill"
