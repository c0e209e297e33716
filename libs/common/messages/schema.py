"""The envelope and decoder shared by every bus message (libs/common/messages/control.py and
libs/common/messages/pool.py hold the messages themselves).

A message is a dataclass encoded as one JSON object (orjson) with two envelope fields,
`{"v": SCHEMA_VERSION, "type": TYPE, ...fields...}`. Decoding is `orjson.loads` plus type
checks built once per class from its annotations; nothing is pickled or evaluated. A
version the receiver does not know, a missing required field or a wrong type raises
`MessageError` naming the field; unknown fields are ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
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
        # The same bytes as dumping to_dict(), without asdict's deep copy of every field
        # (a prompt's ids, one token per chunk): orjson writes nested dataclasses itself.
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return orjson.dumps({"v": SCHEMA_VERSION, "type": self.TYPE, **body})

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

    @classmethod
    def shortcut(cls: type[M], obj: dict) -> M | None:
        """A message decoded once per token may build its usual form here, without the
        per-field checks (None: take the checked path). It must accept only what the
        checked path accepts, and build the same object (tests/messages/test_messages.py)."""
        return None


Check = typing.Callable[[Any, str], Any]  # (value, path) -> checked value, or MessageError


@functools.cache
def _schema(cls: type) -> tuple[tuple[str, Check, bool, frozenset[type]], ...]:
    """(name, check, required, passing types) per field; resolving hints is slow, so
    once per class."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (
            f.name,
            _checker(hints[f.name]),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            _passing(hints[f.name]),
        )
        for f in dataclasses.fields(cls)
        if f.init
    )


def _passing(hint: Any) -> frozenset[type]:
    """Value types that pass a field's check unchanged: a str, int, bool or float field
    (exactly that type: a bool is not an int here), and None where the field is optional."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union or isinstance(hint, types.UnionType):
        plain = [a for a in args if a is not type(None)]
        if len(plain) == 1 and plain[0] in _PLAIN and type(None) in args:
            return frozenset((plain[0], type(None)))
        return frozenset()
    return frozenset((hint,)) if hint in _PLAIN else frozenset()


@functools.cache
def _has_shortcut(cls: type) -> bool:
    """Whether `cls` has a shortcut of its own (the others pay no call per decode)."""
    return issubclass(cls, Message) and cls.shortcut.__func__ is not Message.shortcut.__func__


def _build(cls: type, obj: dict, path: str) -> Any:
    built = cls.shortcut(obj) if _has_shortcut(cls) else None
    if built is not None:
        return built
    values = {}
    for name, check, required, passing in _schema(cls):
        if name in obj:
            value = obj[name]
            # Most fields of a message are plain: no check call, no error path built.
            values[name] = value if type(value) in passing else check(value, f"{path}.{name}")
        elif required:
            raise MessageError(f"{path}.{name}: required field missing")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise MessageError(f"{path}: {e}") from None


@functools.cache
def _checker(hint: Any) -> Check:
    """The check of one field type, built once per type: a decode only runs closures (a
    token stream decodes a message per token; inspecting hints each time was most of it)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return lambda value, _path: value
    if origin is typing.Union or isinstance(hint, types.UnionType):
        return _union_checker(hint)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return _list_checker(item)
    if origin is dict:
        _, item = typing.get_args(hint) or (str, Any)
        return _dict_checker(item)
    if dataclasses.is_dataclass(hint):

        def check_object(value: Any, path: str) -> Any:
            if not isinstance(value, dict):
                raise MessageError(f"{path}: expected an object")
            return _build(hint, value, path)

        return check_object
    if hint is float:

        def check_float(value: Any, path: str) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise MessageError(f"{path}: expected a number")
            return float(value)

        return check_float
    if hint is int:

        def check_int(value: Any, path: str) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise MessageError(f"{path}: expected an integer")
            return value

        return check_int
    if hint in (str, bool):

        def check_exact(value: Any, path: str) -> Any:
            if not isinstance(value, hint):
                raise MessageError(f"{path}: expected {hint.__name__}")
            return value

        return check_exact

    def unsupported(_value: Any, path: str) -> Any:
        raise MessageError(f"{path}: unsupported field type {hint!r}")

    return unsupported


def _union_checker(hint: Any) -> Check:
    args = typing.get_args(hint)
    nullable = type(None) in args
    options = [_checker(option) for option in args if option is not type(None)]

    def check_union(value: Any, path: str) -> Any:
        if value is None and nullable:
            return None
        errors = []
        for check in options:
            try:
                return check(value, path)
            except MessageError as e:
                errors.append(str(e))
        raise MessageError(errors[0] if len(errors) == 1 else f"{path}: no type matches")

    return check_union


# Item types whose values pass unchanged when their Python type is exactly this one (bool is
# not an int here, as in the item check); a list of them is checked in one pass.
_PLAIN = {int: int, float: float, str: str, bool: bool}


def _list_checker(item: Any) -> Check:
    check_item, plain = _checker(item), _PLAIN.get(item)

    def check_list(value: Any, path: str) -> list:
        if not isinstance(value, list):
            raise MessageError(f"{path}: expected a list")
        if plain is not None and all(type(v) is plain for v in value):
            return value  # fresh from orjson: nobody else holds it
        return [check_item(v, f"{path}[{i}]") for i, v in enumerate(value)]

    return check_list


def _dict_checker(item: Any) -> Check:
    check_item = _checker(item)

    def check_dict(value: Any, path: str) -> dict:
        if not isinstance(value, dict):
            raise MessageError(f"{path}: expected an object")
        if item is Any:
            return dict(value)
        return {k: check_item(v, f"{path}.{k}") for k, v in value.items()}

    return check_dict
