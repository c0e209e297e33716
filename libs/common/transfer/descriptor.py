"""The region descriptor: what a peer needs to address a registered memory region.

A descriptor is plain data. It crosses process boundaries inside NATS messages
(JSON, via orjson) and is never pickled. Holding a descriptor is the capability to
read and write the region: the token inside it is checked by the region's owner
(tcp), by the shared-memory region table (shm) or by the NIC through the rkey (rdma).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import orjson

SCHEMA_VERSION = 1
TRANSPORTS = ("tcp", "shm", "rdma")
TOKEN_BYTES = 16
U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1

_FIELDS = ("transport", "endpoint", "region_id", "length", "token", "addr", "rkey")


def _check_uint(name: str, value: Any, limit: int) -> None:
    # bool is an int subclass; a JSON `true` must not pass for a length.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an integer, got {type(value).__name__}")
    if value < 0 or value > limit:
        raise ValueError(f"{name}: {value} is outside [0, {limit}]")


@lru_cache(maxsize=4096)
def _token_bytes(token: str) -> bytes:
    # Every tcp batch part carries the token; decoding its hex costs more than the
    # small batch's own header (a bounded cache, keyed by the token text).
    return bytes.fromhex(token)


@dataclass(frozen=True, slots=True)
class RegionDescriptor:
    """Address of one registered region, valid until its owner unregisters it.

    Fields:
      transport  "tcp" | "shm" | "rdma": which engine can use it.
      endpoint   where the region lives: "host:port" of the owner's transfer server
                 (tcp), "<host id>:<segment name>" (shm), the owner's engine id (rdma).
      region_id  the owner's id for the region (random, so a stale descriptor from a
                 previous run does not silently address a new region).
      length     bytes addressable, offsets in ops are relative to the region start.
      token      32 hex chars (128 random bits); kept out of repr so it is not logged.
      addr       rdma: the virtual address of the region; shm: offset in the segment.
      rkey       rdma only: the memory region's remote key.
    """

    transport: str
    endpoint: str
    region_id: int
    length: int
    token: str = field(repr=False)
    addr: int = 0
    rkey: int = 0

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: {self.transport!r} is not one of {TRANSPORTS}")
        if not isinstance(self.endpoint, str) or not self.endpoint:
            raise ValueError("endpoint: expected a non-empty string")
        _check_uint("region_id", self.region_id, U64_MAX)
        _check_uint("length", self.length, U64_MAX)
        _check_uint("addr", self.addr, U64_MAX)
        _check_uint("rkey", self.rkey, U32_MAX)
        if not isinstance(self.token, str) or len(self.token) != 2 * TOKEN_BYTES:
            raise ValueError(f"token: expected {2 * TOKEN_BYTES} hex characters")
        try:
            bytes.fromhex(self.token)
        except ValueError:
            raise ValueError("token: not hexadecimal") from None

    @property
    def token_bytes(self) -> bytes:
        return _token_bytes(self.token)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": SCHEMA_VERSION}
        for name in _FIELDS:
            out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RegionDescriptor:
        """Build from decoded JSON; every field is type- and range-checked."""
        if not isinstance(data, Mapping):
            raise ValueError("descriptor: expected a JSON object")
        version = data.get("v")
        if version != SCHEMA_VERSION:
            raise ValueError(f"v: unsupported descriptor schema version {version!r}")
        unknown = set(data) - set(_FIELDS) - {"v"}
        if unknown:
            raise ValueError(f"descriptor: unknown fields {sorted(unknown)}")
        required = ("transport", "endpoint", "region_id", "length", "token")
        missing = [n for n in required if n not in data]
        if missing:
            raise ValueError(f"descriptor: missing fields {missing}")
        return cls(**{name: data[name] for name in _FIELDS if name in data})

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict())

    @classmethod
    def from_json(cls, raw: bytes | str) -> RegionDescriptor:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"descriptor: invalid JSON ({exc})") from None
        return cls.from_dict(data)
