"""Every message that crosses a process boundary over NATS, in one place.

Each message is a dataclass encoded as one JSON object (orjson) with two envelope fields:

    {"v": 1, "type": "service_info", ...fields...}

`v` is the schema version: a receiver refuses a version it does not know, with an error
that says both versions. Unknown fields are ignored (a newer sender may add optional
fields without a version bump); missing required fields and wrong types are refused with
`MessageError` naming the field. Nothing is pickled or evaluated: decoding is
`orjson.loads` plus type checks against the dataclass annotations.

Subjects and which message travels on each are listed in docs/protocol.md.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import orjson

SCHEMA_VERSION = 1

M = TypeVar("M", bound="Message")


class MessageError(ValueError):
    """A message could not be decoded or failed validation."""


@dataclass
class Message:
    """Base of every bus message. Subclasses set `TYPE` and declare typed fields."""

    TYPE: ClassVar[str] = "message"

    def to_dict(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        return {"v": SCHEMA_VERSION, "type": self.TYPE, **body}

    def encode(self) -> bytes:
        return orjson.dumps(self.to_dict())

    @classmethod
    def decode(cls: type[M], data: bytes | str) -> M:
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise MessageError(f"{cls.TYPE}: not valid JSON ({e})") from None
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls: type[M], obj: Any) -> M:
        if not isinstance(obj, dict):
            raise MessageError(f"{cls.TYPE}: expected a JSON object")
        version = obj.get("v", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise MessageError(
                f"{cls.TYPE}: schema version {version!r} not supported (this build speaks "
                f"{SCHEMA_VERSION})"
            )
        kind = obj.get("type", cls.TYPE)
        if kind != cls.TYPE:
            raise MessageError(f"expected message type {cls.TYPE!r}, got {kind!r}")
        return _build(cls, obj, cls.TYPE)


def _build(cls: type, obj: dict, path: str) -> Any:
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in obj:
            values[f.name] = _check(obj[f.name], hints[f.name], f"{path}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise MessageError(f"{path}.{f.name}: required field missing")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise MessageError(f"{path}: {e}") from None


def _check(value: Any, hint: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin is typing.Union or isinstance(hint, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check(value, option, path)
            except MessageError as e:
                errors.append(str(e))
        raise MessageError(errors[0] if len(errors) == 1 else f"{path}: no type matches")
    if origin is list:
        if not isinstance(value, list):
            raise MessageError(f"{path}: expected a list")
        (item,) = typing.get_args(hint) or (Any,)
        return [_check(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise MessageError(f"{path}: expected an object")
        _, item = typing.get_args(hint) or (str, Any)
        return {k: _check(v, item, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise MessageError(f"{path}: expected an object")
        return _build(hint, value, path)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MessageError(f"{path}: expected a number")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise MessageError(f"{path}: expected an integer")
        return value
    if hint in (str, bool):
        if not isinstance(value, hint):
            raise MessageError(f"{path}: expected {hint.__name__}")
        return value
    raise MessageError(f"{path}: unsupported field type {hint!r}")


# --- generic replies --------------------------------------------------------------------


@dataclass
class ErrorReply(Message):
    """Body of an error reply (the `Nats-Service-Error[-Code]` headers say the same)."""

    TYPE: ClassVar[str] = "error"
    code: int
    message: str


@dataclass
class InfoRequest(Message):
    """Asks a service for its `ServiceInfo`. Empty today; a body is optional."""

    TYPE: ClassVar[str] = "info_request"


@dataclass
class ServiceInfo(Message):
    """Reply of every service's `info` endpoint.

    `details` holds what is specific to a role (model id, page size, kv dtype, transport…),
    as plain strings, numbers and booleans.
    """

    TYPE: ClassVar[str] = "service_info"
    service: str
    service_id: str
    version: str
    started_at: float
    nats_url: str
    details: dict[str, Any] = field(default_factory=dict)
