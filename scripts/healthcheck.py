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
- nats: the nats-server monitoring endpoint `/healthz` answers 200, on
  127.0.0.1:$NATS_MONITOR_PORT (default 8222).

Health checks run every few seconds in every container, so this stays cheap: the standard
library only (a few lines of the NATS text protocol instead of nats-py, whose import costs
seconds of CPU on a busy 2-core host); tls:// and ws:// URLs fall back to nats-py.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import secrets
import socket
import sys
import time
import urllib.parse
from collections.abc import Mapping

from libs.common.bus.credentials import Credentials, inbox_prefix, read_credentials
from libs.common.config import CommonConfig
from libs.common.flags import env_names

SERVICES = ("cache_master", "cache_store", "prefill", "decode", "router", "planner")


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
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return f"{url}: {reply.status}"
    except urllib.error.HTTPError as e:
        raise Unhealthy(f"{url}: HTTP {e.code}: {e.read()[:200]!r}") from None
    except OSError as e:
        raise Unhealthy(f"{url}: {e}") from None


class MiniNats:
    """Just enough of the NATS client protocol for request/reply over plain TCP.

    CONNECT (the service's credentials file, or user/password or token from the URL), SUB
    an inbox under the identity's own prefix, PUB with reply-to, read MSG/HMSG; answers
    the server's PINGs. One connection, one thread, blocking with a deadline. Replies with
    headers (micro errors, no-responders 503) are returned raw.
    """

    def __init__(self, url: str, timeout: float, creds: Credentials | None = None):
        parsed = urllib.parse.urlsplit(url)
        self.deadline = time.monotonic() + timeout
        self.sock = socket.create_connection((parsed.hostname, parsed.port or 4222), timeout)
        self.buf = b""
        options: dict[str, object] = {"verbose": False, "pedantic": False, "headers": True}
        options |= {"no_responders": True, "protocol": 1, "name": "tandem-healthcheck"}
        # As nats-py reads them (no percent-decoding), so healthy means "the service could".
        user = ""
        if creds is not None:
            user, options["user"], options["pass"] = creds.user, creds.user, creds.password
        elif parsed.username and parsed.password is not None:
            user, options["user"], options["pass"] = (
                parsed.username,
                parsed.username,
                parsed.password,
            )
        elif parsed.username:
            options["auth_token"] = parsed.username
        self.inbox = f"{inbox_prefix(user) if user else '_INBOX'}.hc{secrets.token_hex(8)}"
        self._expect(b"INFO ")
        self._send(b"CONNECT " + _json(options) + b"\r\nPING\r\n")
        self._expect(b"PONG")
        self._send(f"SUB {self.inbox}.* 1\r\n".encode())

    def close(self) -> None:
        self.sock.close()

    def _send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _fill(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer from NATS in time")
        self.sock.settimeout(left)
        chunk = self.sock.recv(65536)
        if not chunk:
            raise Unhealthy("NATS closed the connection")
        self.buf += chunk

    def _expect(self, start: bytes) -> bytes:
        while True:
            line = self._line()
            if line.startswith(b"-ERR"):
                raise Unhealthy(f"NATS: {line.decode(errors='replace')}")
            if line == b"PING":
                self._send(b"PONG\r\n")
            elif line.startswith(start):
                return line

    def request(self, subject: str, payload: bytes, wait: float | None = None) -> list[bytes]:
        """Publish with a reply inbox; return the first reply, or all replies within `wait`."""
        reply = f"{self.inbox}.{secrets.token_hex(4)}"
        self._send(f"PUB {subject} {reply} {len(payload)}\r\n".encode() + payload + b"\r\n")
        if wait is not None:
            self.deadline = min(self.deadline, time.monotonic() + wait)
        replies: list[bytes] = []
        while True:
            try:
                line = self._expect(b"")
            except TimeoutError:
                if wait is not None:
                    return replies
                raise
            parts = line.split()
            if not parts or parts[0] not in (b"MSG", b"HMSG"):
                continue
            size = int(parts[-1])
            while len(self.buf) < size + 2:
                self._fill()
            body, self.buf = self.buf[:size], self.buf[size + 2 :]
            if parts[0] == b"HMSG":
                body = b"HEADERS " + body  # headers: an error or no-responders status
            replies.append(body)
            if wait is None:
                return replies


def _json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def check_nats_service(
    config: CommonConfig, explicit_id: bool, timeout: float, hostname: str | None = None
) -> str:
    """Ask this host's instance of `config.SERVICE` for its info over NATS."""
    service = config.SERVICE
    urls = [u.strip() for u in config.nats_url.split(",") if u.strip()]
    if any(not u.startswith("nats://") for u in urls):
        import asyncio

        return asyncio.run(_check_with_nats_py(config, explicit_id, timeout, hostname))
    errors = []
    try:
        creds = (
            read_credentials(config.nats_credentials_file) if config.nats_credentials_file else None
        )
    except ValueError as e:
        raise Unhealthy(str(e)) from None
    for url in urls:
        try:
            nc = MiniNats(url, timeout, creds)
        except (OSError, Unhealthy, TimeoutError) as e:
            errors.append(f"{urllib.parse.urlsplit(url).hostname}: {e}")
            continue
        try:
            if explicit_id:
                ids = [config.service_id]
            else:
                prefix = host_prefix(service, hostname)
                pings = nc.request(f"$SRV.PING.tandem-{service}", b"", wait=min(0.5, timeout))
                found = [json.loads(p) for p in pings if not p.startswith(b"HEADERS ")]
                ids = sorted(
                    sid
                    for r in found
                    if (sid := (r.get("metadata") or {}).get("service_id", "")).startswith(prefix)
                )
                if not ids:
                    raise Unhealthy(f"no tandem-{service} instance of this host ({prefix}*)")
                nc.deadline = time.monotonic() + timeout
            subject = f"{config.subject_prefix}.{service}.{ids[0]}.info"
            (body,) = nc.request(subject, b"{}")
            if body.startswith(b"HEADERS "):
                raise Unhealthy(f"{subject}: error reply {body[8:200]!r}")
            info = json.loads(body)
            if info.get("service_id") != ids[0]:
                raise Unhealthy(f"{subject}: answered by {info.get('service_id')!r}")
            return f"{subject}: {service} {ids[0]} up since {info.get('started_at', 0):.0f}"
        except (OSError, TimeoutError, ValueError) as e:
            raise Unhealthy(f"{service}: {type(e).__name__}: {e}") from None
        finally:
            nc.close()
    raise Unhealthy("cannot reach NATS: " + "; ".join(errors))


async def _check_with_nats_py(
    config: CommonConfig, explicit_id: bool, timeout: float, hostname: str | None
) -> str:
    """The same check through nats-py, for tls:// and ws:// URLs (slower to import)."""
    import nats

    from libs.common.bus.connection import discover
    from libs.common.bus.credentials import connect_options

    service = config.SERVICE
    try:
        nc = await nats.connect(
            servers=[u.strip() for u in config.nats_url.split(",")],
            connect_timeout=timeout,
            allow_reconnect=False,
            **connect_options(config.nats_url, config.nats_credentials_file),
        )
    except Exception as e:
        raise Unhealthy(f"cannot connect to NATS: {type(e).__name__}: {e}") from None
    try:
        ids = [config.service_id]
        if not explicit_id:
            prefix = host_prefix(service, hostname)
            pings = await discover(nc, f"tandem-{service}", timeout=min(0.5, timeout))
            ids = sorted(
                sid
                for r in pings
                if (sid := (r.get("metadata") or {}).get("service_id", "")).startswith(prefix)
            )
            if not ids:
                raise Unhealthy(f"no tandem-{service} instance of this host ({prefix}*)")
        subject = f"{config.subject_prefix}.{service}.{ids[0]}.info"
        try:
            msg = await nc.request(subject, b"{}", timeout=timeout)
        except Exception as e:
            raise Unhealthy(f"{subject}: {type(e).__name__}: {e}") from None
        if msg.headers:
            raise Unhealthy(f"{subject}: error reply {msg.headers}")
        return f"{subject}: {service} {ids[0]} up"
    finally:
        await nc.close()


def check(service: str, environ: Mapping[str, str], timeout: float) -> str:
    """Run the check of `service`; return a one-line report or raise Unhealthy."""
    if service == "nats":
        port = int(environ.get("NATS_MONITOR_PORT") or 8222)
        return check_http(f"http://127.0.0.1:{port}/healthz", timeout)
    config, explicit = load_config(service, environ)
    if service == "router":
        host = config.host if config.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return check_http(f"http://{host}:{config.port}/health", timeout)
    return check_nats_service(config, explicit, timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.healthcheck", description=__doc__)
    parser.add_argument("service", choices=(*SERVICES, "nats"))
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per step")
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
