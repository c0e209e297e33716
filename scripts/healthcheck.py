"""Health check of one service, for container health checks and probes: exit 0 healthy, 1 not.

    python -m scripts.healthcheck <service> [--timeout SECONDS]

It reads the same flags' environment variables as the service it checks (TANDEM_*), so in
a container it needs no arguments beyond the service name:

- router: `GET http://127.0.0.1:<port>/health` answers 200 (the router's own judgement of
  whether it can serve).
- cache_master, cache_store, prefill, decode (no HTTP): the service's micro `info`
  endpoint answers over NATS. With `--service-id` unset the instance is the one whose
  default id `<service>-<this host>-<pid>` names this host (a container's hostname), found
  by micro discovery (`$SRV.PING.tandem-<service>`); with it set, that id is asked directly.
- nats: the nats-server monitoring endpoint `/healthz` (JetStream included) answers 200,
  on 127.0.0.1:$NATS_MONITOR_PORT (default 8222).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import re
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping

import nats

from libs.common.bus import discover
from libs.common.config import CommonConfig, env_names
from libs.common.messages import InfoRequest, MessageError, ServiceInfo

SERVICES = ("cache_master", "cache_store", "prefill", "decode", "router")


class Unhealthy(Exception):
    """The check failed; the message says why."""


def config_class(service: str) -> type[CommonConfig]:
    """The config dataclass of `services.<service>` (the one whose SERVICE is `service`)."""
    module = importlib.import_module(f"services.{service}.config")
    for obj in vars(module).values():
        if isinstance(obj, type) and issubclass(obj, CommonConfig) and obj.SERVICE == service:
            return obj
    raise LookupError(f"services/{service}/config.py defines no config for {service!r}")


def host_prefix(service: str, hostname: str | None = None) -> str:
    """The start of this host's default service ids (see libs.common.config)."""
    host = re.sub(r"[^a-z0-9-]", "-", (hostname or socket.gethostname()).lower())
    return f"{service}-{host[:40].strip('-') or 'host'}-"


def load_config(service: str, env: Mapping[str, str]) -> tuple[CommonConfig, bool]:
    """The service's config from `env`, and whether its service id was set explicitly."""
    cls = config_class(service)
    explicit = any(env.get(name) for name in env_names(service, "service_id"))
    return cls.parse([], env=env), explicit


def check_http(url: str, timeout: float) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return f"{url}: {reply.status}"
    except urllib.error.HTTPError as e:
        raise Unhealthy(f"{url}: HTTP {e.code}: {e.read()[:200]!r}") from None
    except OSError as e:
        raise Unhealthy(f"{url}: {e}") from None


async def check_nats_service(
    config: CommonConfig, explicit_id: bool, timeout: float, hostname: str | None = None
) -> str:
    """Ask this host's instance of `config.SERVICE` for its info over NATS."""
    service = config.SERVICE
    try:
        nc = await nats.connect(
            servers=[u.strip() for u in config.nats_url.split(",")],
            connect_timeout=timeout,
            max_reconnect_attempts=0,
            allow_reconnect=False,
        )
    except Exception as e:
        raise Unhealthy(f"cannot connect to NATS: {type(e).__name__}: {e}") from None
    try:
        if explicit_id:
            ids = [config.service_id]
        else:
            prefix = host_prefix(service, hostname)
            replies = await discover(nc, f"tandem-{service}", timeout=min(0.5, timeout / 2))
            ids = sorted(
                sid
                for r in replies
                if (sid := (r.get("metadata") or {}).get("service_id", "")).startswith(prefix)
            )
            if not ids:
                raise Unhealthy(f"no tandem-{service} instance of this host ({prefix}*) on NATS")
        subject = f"{config.subject_prefix}.{service}.{ids[0]}.info"
        try:
            msg = await nc.request(subject, InfoRequest().encode(), timeout=timeout)
            info = ServiceInfo.decode(msg.data)
        except (nats.errors.Error, MessageError, TimeoutError) as e:
            raise Unhealthy(f"{subject}: {type(e).__name__}: {e}") from None
        if info.service_id != ids[0]:
            raise Unhealthy(f"{subject}: answered by {info.service_id!r}")
        return f"{subject}: {service} {info.service_id} up since {info.started_at:.0f}"
    finally:
        await nc.close()


def check(service: str, environ: Mapping[str, str], timeout: float) -> str:
    """Run the check of `service`; return a one-line report or raise Unhealthy."""
    env = dict(environ)
    if service == "nats":
        port = int(env.get("NATS_MONITOR_PORT") or 8222)
        return check_http(f"http://127.0.0.1:{port}/healthz", timeout)
    config, explicit = load_config(service, env)
    if service == "router":
        host = config.host if config.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return check_http(f"http://{host}:{config.port}/health", timeout)
    return asyncio.run(asyncio.wait_for(check_nats_service(config, explicit, timeout), timeout * 2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.healthcheck", description=__doc__)
    parser.add_argument("service", choices=(*SERVICES, "nats"))
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per step")
    args = parser.parse_args(argv)
    try:
        print(check(args.service, os.environ, args.timeout))
        return 0
    except (Unhealthy, TimeoutError) as e:
        print(f"unhealthy: {e or 'timed out'}", file=sys.stderr)
        return 1
    except SystemExit as e:  # a config that does not parse: the service cannot be healthy
        print(f"unhealthy: configuration error ({e})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
