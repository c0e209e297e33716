"""How a config dataclass's fields become flags and environment variables.

A field's names (`flag_name`, `env_names`), the argparse parser of a whole dataclass
(`build_parser`), the conversion of a flag's text to the field's type (`convert`), and the
checks `validate` methods share (`require_positive`, `require_range`). The dataclasses
themselves and the precedence of their sources are in libs/common/config.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

ENV_PREFIX = "TANDEM_"


def flag_name(field_name: str) -> str:
    """`drain_timeout` -> `--drain-timeout`."""
    return "--" + field_name.replace("_", "-")


def env_names(service: str, field_name: str) -> tuple[str, str]:
    """The service-specific and the shared environment variable of a field."""
    upper = field_name.upper()
    return f"{ENV_PREFIX}{service.upper()}_{upper}", f"{ENV_PREFIX}{upper}"


def require_positive(config: Any, name: str) -> None:
    """ValueError naming the flag unless the field `name` of `config` is > 0."""
    if getattr(config, name) <= 0:
        raise ValueError(f"{flag_name(name)}: must be > 0, got {getattr(config, name)!r}")


def require_range(config: Any, name: str, low: float, high: float) -> None:
    """ValueError naming the flag unless low <= the field `name` of `config` <= high."""
    value = getattr(config, name)
    if not low <= value <= high:
        raise ValueError(f"{flag_name(name)}: must be in [{low}, {high}], got {value!r}")


def build_parser(cls: type[Any]) -> argparse.ArgumentParser:
    """The argparse parser of a config dataclass (a CommonConfig): one flag per field."""
    parser = argparse.ArgumentParser(
        prog=f"python -m services.{cls.SERVICE}",
        description=(cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else None,
        epilog=(
            f"Every flag can also be set by ${ENV_PREFIX}{cls.SERVICE.upper()}_<FLAG> "
            f"(this service only) or ${ENV_PREFIX}<FLAG> (all services); the command "
            "line wins over both."
        ),
    )
    for f in init_fields(cls):
        own, shared = env_names(cls.SERVICE, f.name)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            raise TypeError(f"{cls.__name__}.{f.name} has no default: every flag needs one")
        help_text = f"{f.metadata.get('help', '')} [env {own} or {shared}; default {default!r}]"
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        kwargs["type"] = lambda raw, f=f: convert(cls, f, raw)
        kwargs["metavar"] = _base_type(cls, f).__name__.upper()
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
            kwargs["metavar"] = "{" + ",".join(f.metadata["choices"]) + "}"
        parser.add_argument(flag_name(f.name), **kwargs)
    return parser


def init_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of a config dataclass that are flags (those its __init__ takes)."""
    return [f for f in dataclasses.fields(cls) if f.init]


def _base_type(cls: type, f: dataclasses.Field) -> type:
    hint = typing.get_type_hints(cls)[f.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def convert(cls: type, f: dataclasses.Field, raw: str) -> Any:
    """A flag's or a variable's text as the field's type; ValueError if it is not one."""
    kind = _base_type(cls, f)
    if kind is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true/false, got {raw!r}")
    if kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"expected {kind.__name__}, got {raw!r}") from None
    return raw
