"""Keyed MACs of pool objects: only holders of the cluster's KV secret can write KV that
workers will decode from.

    mac = KvMac.from_file(path)          # the cluster secret (>= 16 bytes), never argv
    tag = mac.tag(key, data)             # the writer, from the bytes it sends
    mac.verify(key, data, tag)           # every reader, on the bytes it read

A tag is `<key id>.<mac>`: the key id (8 hex chars) names the secret it was made with
(an HMAC of a constant under the secret: it reveals nothing of the secret), the MAC
(32 hex chars) is HMAC-SHA256 truncated to 128 bits over the object's key, its length and
its bytes, so bytes moved under another key or truncated do not verify. HMAC-SHA256 is
OpenSSL's through `hmac` (SHA-NI where the CPU has it): measured twice as fast as
keyed blake2b on this project's hosts (docs/benchmarks.md, "Pool integrity").

A reader tells apart a tag made with its own secret that does not verify (forged or
altered bytes: that copy is bad and may be reported) from a tag made with another secret,
or none (a worker with another secret or with integrity off wrote it: a miss for this
reader, never reported, so a misconfigured reader cannot delete good data). docs/pool.md,
"Integrity".
"""

from __future__ import annotations

import hmac
import os
import re
from pathlib import Path
from typing import Any

SECRET_FILE_ENV = "TANDEM_KV_SECRET_FILE"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
TAG_RE = re.compile(r"^[0-9a-f]{8}\.[0-9a-f]{32}$")
_MAC_CONTEXT = b"tandem kv pool mac v1"
_ID_CONTEXT = b"tandem kv pool key id v1"
_HANDOFF_CONTEXT = b"tandem kv handoff mac v1"


class KvMac:
    """Makes and checks pool object tags with one cluster secret."""

    def __init__(self, secret: bytes):
        if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
            raise ValueError(f"--kv-secret-file: the secret must have {MIN_SECRET_BYTES} to "
                             f"{MAX_SECRET_BYTES} bytes, it has {len(secret)}")  # fmt: skip
        # Derived keys: the file's bytes are never used twice for different purposes.
        self._key = hmac.digest(secret, _MAC_CONTEXT, "sha256")
        self.key_id = hmac.digest(secret, _ID_CONTEXT, "sha256")[:4].hex()
        # The prefill -> decode handoff's MAC key (libs/common/worker/handoff/protocol.py).
        self.handoff_key = hmac.digest(secret, _HANDOFF_CONTEXT, "sha256")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> KvMac:
        """The secret is the file's bytes, surrounding whitespace removed (so `openssl
        rand -hex 32 > f` works). Raises ValueError naming the flag."""
        try:
            data = Path(path).read_bytes()[: MAX_SECRET_BYTES + 64]
        except OSError as e:
            raise ValueError(f"--kv-secret-file: cannot read {path}: {e.strerror}") from None
        return cls(data.strip())

    def tag(self, key: str, data: Any) -> str:
        view = memoryview(data)
        encoded = key.encode()
        h = hmac.new(self._key, len(encoded).to_bytes(2, "big") + encoded
                     + view.nbytes.to_bytes(8, "big"), "sha256")  # fmt: skip
        h.update(view)
        return f"{self.key_id}.{h.hexdigest()[:32]}"

    def mine(self, tag: str) -> bool:
        """Whether `tag` claims to be made with this secret (it may still be forged)."""
        return len(tag) == 41 and tag.startswith(self.key_id) and tag[8] == "."

    def verify(self, key: str, data: Any, tag: str) -> bool:
        return self.mine(tag) and hmac.compare_digest(self.tag(key, data), tag)


def load_kv_mac(path: str = "") -> KvMac | None:
    """The MAC of `path`, else of $TANDEM_KV_SECRET_FILE, else None (integrity off)."""
    path = path or os.environ.get(SECRET_FILE_ENV, "")
    return KvMac.from_file(path) if path else None
