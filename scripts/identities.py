"""The deployment's secrets: a NATS identity per service, and the pool's KV secret.

    python -m scripts.identities DIR [--prefix tandem] [--identity NAME=ROLE[@ID] ...]
                                 [--export DIR] [--owner USER] [--context-url URL]

Writes into DIR (made 0700), keeping what is already there, so passwords stay the same
across runs and restarts:

    <name>.credentials   one line `user:password` per identity (0600); a service reads it
                         with --nats-credentials-file
    nats-auth.conf       nats-server's `authorization { users = [...] }`: every identity
                         with its publish/subscribe allow lists (libs/common/bus/
                         permissions.py); rewritten each time from the credentials (0600)
    route.password       the password of a clustered nats-server's routes (Kubernetes)
    kv.secret            the pool's KV MAC secret (--kv-secret-file; libs/common/pool/
                         integrity.py), 32 random bytes in hex

Identities: one per role by default (router, prefill, decode, cache_master, cache_store,
cli), each for every instance of its role; `--identity decode-1=decode@decode-1` binds
one to a service id (scripts/cluster.py does, for `make run`). Passwords come from
`secrets` and never reach a command line.

`--export DIR` (compose.yaml's `secrets` service) then copies each piece into the folder
of DIR that is meant for it, one volume each, so a container sees only its own:
DIR/<name>/credentials, DIR/nats/nats-auth.conf, DIR/kv/kv.secret, and for the cli
DIR/cli/context/tandem.json (a NATS CLI context: url, user, password, inbox prefix).
Folders that do not exist are skipped; `--owner` gives the copies to that user.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import secrets
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from libs.common.bus.credentials import Credentials, inbox_prefix, parse_credentials
from libs.common.bus.permissions import ROLES, permissions

AUTH_CONF = "nats-auth.conf"
KV_SECRET = "kv.secret"
ROUTE_PASSWORD = "route.password"


@dataclass(frozen=True)
class Identity:
    """A NATS user `name` acting as `role`, bound to service id `scope` (`*`: any)."""

    name: str
    role: str
    scope: str = "*"

    @classmethod
    def parse(cls, text: str) -> Identity:
        """`NAME=ROLE[@ID]`."""
        name, _, rest = text.partition("=")
        role, _, scope = rest.partition("@")
        identity = cls(name, role, scope or "*")
        if role not in ROLES:
            raise ValueError(f"--identity {text}: role must be one of {list(ROLES)}")
        if identity.scope != "*" and not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,63}", scope):
            raise ValueError(f"--identity {text}: the id must be a --service-id")
        parse_credentials(f"{name}:x", f"--identity {text}")  # the name is a valid user
        return identity


DEFAULT_IDENTITIES = tuple(Identity(role, role) for role in ROLES if role != "both")


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, mode 0600 from the first byte, replacing it atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)


def _kept(path: Path, make: str) -> str:
    """The content of `path`; written first (0600) with `make` when it is missing."""
    if not path.exists():
        write_private(path, make)
    return path.read_text()


def ensure(
    folder: Path,
    identities: Iterable[Identity] = DEFAULT_IDENTITIES,
    prefix: str = "tandem",
    kv_secret: bool = True,
) -> dict[str, Path]:
    """Make (or keep) every identity's credentials, the route password and (`kv_secret`)
    the KV secret in `folder`; rewrite nats-auth.conf for exactly `identities`.
    Returns identity name -> credentials file."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    users, files = [], {}
    for identity in identities:
        path = folder / f"{identity.name}.credentials"
        fresh = Credentials(identity.name, secrets.token_urlsafe(32)).line()
        creds = parse_credentials(_kept(path, fresh), str(path))
        if creds.user != identity.name:
            raise ValueError(f"{path}: user {creds.user!r}, expected {identity.name!r}")
        users.append((identity, creds))
        files[identity.name] = path
    _kept(folder / ROUTE_PASSWORD, secrets.token_urlsafe(32))  # no newline: an env value
    write_private(folder / AUTH_CONF, authorization(users, prefix))
    if kv_secret:
        _kept(folder / KV_SECRET, secrets.token_hex(32) + "\n")
    return files


def authorization(users: Iterable[tuple[Identity, Credentials]], prefix: str) -> str:
    """nats-server's `authorization` block for these users (JSON values: quoted, so a
    `$` in a subject is never read as a variable)."""
    q = json.dumps
    lines = [
        "# Generated by `python -m scripts.identities`: one NATS user per Tandem identity,",
        "# with allow lists from libs/common/bus/permissions.py. Passwords: keep this private.",
        "authorization {",
        "  users = [",
    ]
    for identity, creds in users:
        perms = permissions(identity.role, identity.name, prefix, identity.scope)
        lines += [
            f"    {{  # {identity.role}, service id {identity.scope}",
            f"      user: {q(creds.user)}",
            f"      password: {q(creds.password)}",
            "      permissions: {",
            f"        publish: {{ allow: {q(list(perms.publish))} }}",
            f"        subscribe: {{ allow: {q(list(perms.subscribe))} }}",
        ]
        if perms.responses:
            lines.append("        allow_responses: true")
        lines += ["      }", "    }"]
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def natscli_context(creds: Credentials, url: str) -> str:
    """A NATS CLI context for `creds` (`nats --context tandem ...`)."""
    context = {"description": "Tandem operator (read-only)", "url": url, "user": creds.user,
               "password": creds.password, "inbox_prefix": inbox_prefix(creds.user)}  # fmt: skip
    return json.dumps(context, indent=2) + "\n"


def export(folder: Path, target: Path, names: Iterable[str], owner: str, url: str) -> list[str]:
    """Copy each piece of `folder` into its own folder of `target` (those that exist)."""
    pieces = {f"{name}/credentials": folder / f"{name}.credentials" for name in names}
    pieces |= {f"nats/{AUTH_CONF}": folder / AUTH_CONF, f"kv/{KV_SECRET}": folder / KV_SECRET}
    cli = folder / "cli.credentials"
    texts = {rel: src.read_text() for rel, src in pieces.items()}
    if cli.exists():
        texts["cli/context/tandem.json"] = natscli_context(parse_credentials(cli.read_text()), url)
    uid = gid = -1
    if owner:
        entry = pwd.getpwnam(owner)
        uid, gid = entry.pw_uid, entry.pw_gid
    done = []
    for rel, text in texts.items():
        dest = target / rel
        if not (target / rel.split("/")[0]).is_dir():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        write_private(dest, text)
        if owner:
            shutil.chown(dest, uid, gid)
            shutil.chown(dest.parent, uid, gid)
        done.append(rel)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.identities",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("folder", type=Path, help="where the secrets are kept (made 0700)")
    parser.add_argument("--prefix", default="tandem", help="the services' --subject-prefix")
    parser.add_argument("--identity", action="append", type=Identity.parse, default=None,
                        metavar="NAME=ROLE[@ID]", help="an identity (repeat); default: "
                        "one per role")  # fmt: skip
    parser.add_argument("--export", type=Path, help="copy each piece to its own folder here")
    parser.add_argument("--owner", default="", help="user that owns the exported copies")
    parser.add_argument("--context-url", default="nats://nats:4222",
                        help="server URL in the exported NATS CLI context")  # fmt: skip
    args = parser.parse_args(argv)
    identities = args.identity or DEFAULT_IDENTITIES
    try:
        files = ensure(args.folder, identities, args.prefix)
        print(f"{args.folder}: {', '.join(sorted(files))}, {AUTH_CONF}, {KV_SECRET}")
        if args.export:
            done = export(args.folder, args.export, files, args.owner, args.context_url)
            print(f"exported to {args.export}: {', '.join(done)}")
    except (OSError, ValueError, KeyError) as e:
        print(f"identities: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
