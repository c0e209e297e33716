"""Tenants and their API keys: who a request is for (docs/security.md, "API keys and tenants").

A key is kept only as its SHA-256 digest and found by a dict lookup on the digest of the
key a client presents: the lookup's timing depends on the digest, which tells nothing of
the key. Two formats of `--api-keys-file`:

- a `.toml` file: `[tenants.<name>]` tables (weight, max_concurrency, tokens_per_minute,
  max_queue, share_cache or cache_group) and `[[keys]]` entries (`hash = "sha256:<hex>"`,
  `tenant = "<name>"`);
- any other name: the older format, one key a line (`#` comments), each a plain key or
  `sha256:<hex>`; every key is the default tenant's. A plain `--api-key` joins it.

Without any key there is one tenant, `default`, and nothing to authenticate.
"""

from __future__ import annotations

import hashlib
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_HASH = re.compile(r"^sha256:([0-9a-f]{64})$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_TENANT_FIELDS = ("weight", "max_concurrency", "tokens_per_minute", "max_queue", "share_cache",
                  "cache_group")  # fmt: skip


@dataclass(frozen=True)
class Tenant:
    """One tenant's share and limits. 0 means no bound of the tenant's own (the router's
    bounds still hold). `cache_scope` roots its prefix cache (cache_scope below)."""

    name: str
    weight: float = 1.0
    max_concurrency: int = 0
    tokens_per_minute: int = 0
    max_queue: int = 0
    cache_scope: str = ""  # "": the unsalted cache every request shared before tenants


DEFAULT = Tenant("default")


def digest(key: str) -> bytes:
    """The SHA-256 of a key (an ASCII string: credentials.py refuses anything else)."""
    return hashlib.sha256(key.encode("ascii")).digest()


class KeyRing:
    """Key digests -> tenants. Empty: the API is open, every request is `DEFAULT`'s."""

    def __init__(self, tenants: dict[bytes, Tenant] | None = None):
        self._by_digest = dict(tenants or {})

    def __bool__(self) -> bool:
        return bool(self._by_digest)

    def __len__(self) -> int:
        return len(self._by_digest)

    def tenant(self, key: str) -> Tenant | None:
        """The tenant of `key`, or None when it is no configured key."""
        return self._by_digest.get(digest(key))

    def tenants(self) -> list[Tenant]:
        return sorted(set(self._by_digest.values()), key=lambda t: t.name)


def load_keys(api_key: str = "", path: str = "") -> KeyRing:
    """The keys of `--api-key` and `--api-keys-file`; ValueError naming the flag and the
    line or entry when the file is wrong (the router does not start)."""
    found: dict[bytes, Tenant] = {}
    if api_key:
        found[digest(_ascii_key(api_key, "--api-key"))] = DEFAULT
    if path:
        text = Path(path).read_text(encoding="utf-8")
        found |= _toml_keys(text, path) if path.endswith(".toml") else _line_keys(text, path)
    return KeyRing(found)


def _line_keys(text: str, path: str) -> dict[bytes, Tenant]:
    found = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"--api-keys-file {path}:{n}"
        found[
            _hash(line[7:], where)
            if line.startswith("sha256:")
            else digest(_ascii_key(line, where))
        ] = DEFAULT
    return found


def _toml_keys(text: str, path: str) -> dict[bytes, Tenant]:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--api-keys-file {path}: not valid TOML: {e}") from None
    if set(doc) - {"tenants", "keys"}:
        raise ValueError(
            f"--api-keys-file {path}: unknown tables {sorted(set(doc) - {'tenants', 'keys'})}"
        )
    tables = doc.get("tenants", {})
    if not isinstance(tables, dict):
        raise ValueError(f"--api-keys-file {path}: [tenants] must be a table of tables")
    tenants = {name: _tenant(name, t, f"--api-keys-file {path}: [tenants.{name}]")
               for name, t in tables.items()}  # fmt: skip
    found: dict[bytes, Tenant] = {}
    keys = doc.get("keys", [])
    if not isinstance(keys, list):
        raise ValueError(f"--api-keys-file {path}: keys must be an array of tables ([[keys]])")
    for i, entry in enumerate(keys):
        where = f"--api-keys-file {path}: keys[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"hash", "tenant"}:
            raise ValueError(f"{where}: must have exactly `hash` and `tenant`")
        if entry["tenant"] not in tenants:
            raise ValueError(f"{where}: no [tenants.{entry['tenant']}] table")
        h = entry["hash"]
        if not isinstance(h, str) or not h.startswith("sha256:"):
            raise ValueError(f"{where}: hash must be 'sha256:<64 hex digits>'")
        d = _hash(h[7:], where)
        if d in found:
            raise ValueError(f"{where}: the same key twice")
        found[d] = tenants[entry["tenant"]]
    if not found:
        raise ValueError(
            f"--api-keys-file {path}: no [[keys]] entry (an empty file would open the API)"
        )
    return found


def _tenant(name: str, t: Any, where: str) -> Tenant:
    if not _NAME.match(name):
        raise ValueError(f"{where}: a tenant's name is 1 to 64 of A-Z a-z 0-9 _ . -")
    if not isinstance(t, dict) or set(t) - set(_TENANT_FIELDS):
        raise ValueError(f"{where}: fields are {', '.join(_TENANT_FIELDS)}")
    weight = t.get("weight", 1.0)
    if (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or not (math.isfinite(weight) and 0 < weight <= 1000)
    ):
        raise ValueError(f"{where}: weight must be a number in (0, 1000]")
    ints = {}
    for field in ("max_concurrency", "tokens_per_minute", "max_queue"):
        v = t.get(field, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{where}: {field} must be an integer >= 0 (0: no bound)")
        ints[field] = v
    share, group = t.get("share_cache", False), t.get("cache_group", "")
    if not isinstance(share, bool) or not isinstance(group, str):
        raise ValueError(f"{where}: share_cache is true or false, cache_group a string")
    if share and group:
        raise ValueError(f"{where}: share_cache and cache_group: one or the other")
    if group and not _NAME.match(group):
        raise ValueError(f"{where}: a cache_group's name is 1 to 64 of A-Z a-z 0-9 _ . -")
    scope = "shared" if share else f"group:{group}" if group else f"tenant:{name}"
    return Tenant(name, float(weight), cache_scope=scope, **ints)


def _hash(hexdigest: str, where: str) -> bytes:
    if not _HASH.match("sha256:" + hexdigest):
        raise ValueError(f"{where}: a hash is 'sha256:' and 64 lowercase hex digits")
    return bytes.fromhex(hexdigest)


def _ascii_key(key: str, where: str) -> str:
    if not (0 < len(key) <= 256 and key.isascii() and key.isprintable() and " " not in key):
        raise ValueError(f"{where}: a key is 1 to 256 printable ASCII characters, no spaces")
    return key


def cache_salt(tenant: Tenant, client_salt: str) -> str:
    """The salt a request's page keys chain from: the client's own where the tenant uses
    the unsalted cache (no keys, or the older keys file: one trust domain), else a digest
    of the tenant's scope and the client's salt, so that no two scopes (and no client salt)
    can ever name the same pages."""
    if not tenant.cache_scope:
        return client_salt
    return "t1:" + hashlib.sha256(f"{tenant.cache_scope}\0{client_salt}".encode()).hexdigest()
