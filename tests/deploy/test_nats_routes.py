"""NATS cluster routes log in, as deploy/k8s/base/nats.conf sets them up: real servers.

Each server's `cluster { authorization { user: route, password: $NATS_ROUTE_PASSWORD } }`
and routes whose URLs carry that password (from the pod's environment in k8s). A server
that knows the password joins; one that does not is refused.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path

from scripts.nats_server import NatsServer

CLUSTER = """
server_name: %s
cluster {
  name: tandem
  listen: 127.0.0.1:%d
  authorization {
    user: route
    password: $NATS_ROUTE_PASSWORD
  }
  routes: [
    $NATS_ROUTE_0
  ]
}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _routes(server: NatsServer) -> int:
    url = f"http://127.0.0.1:{server.monitor_port}/routez"
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())["num_routes"]


def _server(tmp_path: Path, name: str, seed_port: int, password: str, monkeypatch) -> NatsServer:
    port = seed_port if name == "a" else _free_port()
    conf = tmp_path / f"{name}.conf"
    conf.write_text(CLUSTER % (name, port))
    monkeypatch.setenv("NATS_ROUTE_PASSWORD", password)  # read by nats-server at start
    monkeypatch.setenv("NATS_ROUTE_0", f"nats-route://route:{password}@127.0.0.1:{seed_port}")
    return NatsServer(tmp_path / name, config_file=conf).start()


def test_only_a_server_with_the_route_password_joins_the_cluster(tmp_path, monkeypatch):
    seed = _free_port()
    servers = [_server(tmp_path, "a", seed, "right-password", monkeypatch)]
    try:
        servers.append(_server(tmp_path, "b", seed, "right-password", monkeypatch))
        servers.append(_server(tmp_path, "c", seed, "wrong-password", monkeypatch))
        a, b, c = servers
        deadline = time.monotonic() + 10
        while _routes(b) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # c has tried by now (it dials at start, then every second)
        assert _routes(a) > 0 and _routes(b) > 0
        assert _routes(c) == 0
        assert "router connection closed: authentication failure" in a.log_path.read_text().lower()
    finally:
        for server in servers:
            server.stop()
