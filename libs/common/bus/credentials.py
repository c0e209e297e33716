"""A service's NATS identity: a user and password read from a file, never from argv.

    --nats-credentials-file PATH   (TANDEM_NATS_CREDENTIALS_FILE, or per service
                                    TANDEM_<SERVICE>_NATS_CREDENTIALS_FILE)

The file holds one line, `user:password` (what scripts/identities.py writes, mode 0600;
a Kubernetes Secret or a compose volume mounts it). The user names the identity, and
with it the inbox prefix its replies come back under (`_INBOX.<user>`), the only inboxes
nats-server lets it read (libs/common/bus/permissions.py). A URL with userinfo
(`nats://user:pass@host:4222`) still works, for development; its user sets the inbox
prefix the same way.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_USER_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # also a token of the inbox subject


def inbox_prefix(user: str) -> str:
    """The reply inbox prefix of `user`: `_INBOX.<user>` (nats-py adds `.<nuid>...`)."""
    return f"_INBOX.{user}"


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str = field(repr=False)

    def line(self) -> str:
        return f"{self.user}:{self.password}\n"


def parse_credentials(text: str, where: str = "credentials") -> Credentials:
    """`user:password` (surrounding whitespace stripped); ValueError naming `where`."""
    user, sep, password = text.strip().partition(":")
    if not sep or not password or "\n" in password:
        raise ValueError(f"{where}: expected one line `user:password`")
    if not _USER_RE.match(user):
        raise ValueError(f"{where}: user must be 1-64 of [A-Za-z0-9_-], got {user!r}")
    return Credentials(user, password)


def read_credentials(path: str | Path) -> Credentials:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--nats-credentials-file: cannot read {path}: {e.strerror}") from None
    return parse_credentials(text, f"--nats-credentials-file {path}")


def url_user(url: str) -> str:
    """The user in the first URL's userinfo, or ""."""
    first = url.split(",")[0].strip()
    return urllib.parse.urlsplit(first).username or ""


def connect_options(url: str, credentials_file: str = "") -> dict[str, Any]:
    """nats-py `connect()` keywords for this identity: user, password, inbox prefix."""
    if not credentials_file:
        user = url_user(url)
        return {"inbox_prefix": inbox_prefix(user)} if _USER_RE.match(user) else {}
    if url_user(url):
        raise ValueError("--nats-credentials-file: --nats-url carries a user too; give one")
    creds = read_credentials(credentials_file)
    prefix = inbox_prefix(creds.user)
    return {"user": creds.user, "password": creds.password, "inbox_prefix": prefix}
