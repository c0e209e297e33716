"""The envelope and the one decoder shared by every bus message (control.py, pool.py,
mounts.py and pins.py beside it hold the messages themselves).

A message is a msgspec Struct declared with its type tag,

    class Usage(Message, tag="usage"):
        prompt_tokens: int

and travels as one JSON object with two envelope fields, `{"type": TAG, ...fields..., "v":
SCHEMA_VERSION}`. Every message type, nested ones included (a TokenChunk inside a
TokenChunkBatch, a pool reply's records), is decoded by the same call: msgspec's JSON
decoder for that class, which parses and checks every field against the annotations in
one pass (nothing is pickled or evaluated). A version or type tag the receiver does not
know, a missing required field or a wrong type raises `MessageError` naming the field by
its path from the message, in the same words whatever the message and the subject it came
on; unknown fields are ignored (a newer sender may add optional fields).

A record nested in messages but never sent alone (a pool object's location) is a `Record`:
typed and checked the same way, without the envelope.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal, TypeVar

import msgspec

SCHEMA_VERSION = 1

M = TypeVar("M", bound="Message")


class MessageError(ValueError):
    """A message could not be decoded or failed validation."""


class _Tag:
    """`cls.TYPE`: the type tag a message class was declared with (`tag=`)."""

    def __get__(self, _obj: Any, owner: type[Message]) -> str:
        tag = owner.__struct_config__.tag
        return tag if isinstance(tag, str) else "message"


class Message(msgspec.Struct, kw_only=True, tag_field="type"):
    """Base of every bus message. Subclasses pass `tag="<type>"` and declare typed fields.

    `v` is keyword-only and last, so subclasses' fields keep their positional order.
    """

    # mypy reads neither a descriptor in a ClassVar nor a Literal of a named constant;
    # msgspec needs both (TYPE is no field; v is checked on decode).
    TYPE: ClassVar[str] = _Tag()  # type: ignore[assignment]
    v: Literal[SCHEMA_VERSION] = SCHEMA_VERSION  # type: ignore[valid-type]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types, envelope included (what `encode` writes)."""
        return msgspec.to_builtins(self)

    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def decode(cls: type[M], data: bytes | str) -> M:
        decoder = _DECODERS.get(cls)
        if decoder is None:
            decoder = _DECODERS[cls] = _decoder_for(cls)
        try:
            return decoder.decode(data)
        except msgspec.ValidationError as e:
            raise MessageError(_explain(cls.TYPE, str(e))) from None
        except msgspec.DecodeError as e:
            raise MessageError(f"{cls.TYPE}: not valid JSON ({e})") from None
        except RecursionError:  # arrays in arrays ... past Python's recursion limit
            raise MessageError(f"{cls.TYPE}: nested too deeply") from None


class Record(msgspec.Struct, gc=False):
    """A typed part of messages that is never sent alone: no envelope. Records are left
    out of the garbage collector's walks (a reply holds hundreds): a record never refers
    back to what holds it, so it can be part of no reference cycle."""


_ENCODER = msgspec.json.Encoder()
_DECODERS: dict[type, msgspec.json.Decoder] = {}


def _decoder_for(cls: type[Message]) -> msgspec.json.Decoder:
    if not isinstance(cls.__struct_config__.tag, str):
        raise TypeError(f"{cls.__name__}: a message class needs tag='<type>'")
    return msgspec.json.Decoder(cls)


# msgspec's validation errors read "<what> - at `$.<path>`" (no path: the message itself).
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]*)`$")


def _explain(type_name: str, error: str) -> str:
    """One wording for every validation error: `<type><path>: <what>`, e.g.
    `token_chunk_batch.chunks[3].index: Expected `int`, got `str``."""
    m = _AT.match(error)
    what, path = (m["what"], m["path"] or "") if m else (error, "")
    missing = _MISSING.match(what)
    if missing:
        return f"{type_name}{path}.{missing['name']}: required field missing"
    if path.endswith(".v") and what.startswith("Invalid enum value"):
        value = what.removeprefix("Invalid enum value ")
        return (f"{type_name}{path}: schema version {value} not supported (this build "
                f"speaks {SCHEMA_VERSION})")  # fmt: skip
    if path.endswith(".type") and what.startswith("Invalid value"):
        got = what.removeprefix("Invalid value ")
        if path == ".type":
            return f"{type_name}.type: expected message type {type_name!r}, got {got}"
        return f"{type_name}{path}: unexpected message type {got}"
    return f"{type_name}{path}: {what}"
