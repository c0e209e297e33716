"""The bounds on what a request's grammars and tools may cost, checked before any of them
is converted or compiled (docs/security.md has the table).

    limits = GrammarLimits.of(config)
    check_body(body, limits)        # on the event loop, before parsing: O(1) per field
    limits.text(param, text)        # a grammar's text as sent: characters, then rules
    limits.schema(param, schema)    # a JSON schema's size as JSON text (O(its size))
    limits.tool_schema(i, schema)   # one tool's parameters schema

Every refusal is a 400 naming the field and the limit. The text and schema checks are
O(the text), so they run with the conversion's thread, not on the loop (output.py);
check_body only takes lengths, so it runs first, on the loop, before a body's tools are
even read one by one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from services.router.errors import bad_request

# The fields that may carry a grammar as a string (a regex, EBNF, Lark or a schema as JSON
# text), at the top of a body or inside vLLM's structured_outputs.
_STRING_FIELDS = ("regex", "ebnf", "guided_regex", "guided_grammar", "guided_json")
_NESTED_FIELDS = ("regex", "grammar", "json")
# The start of a rule definition: GBNF's `name ::=` or Lark's `name:` (`?name:`, `name.2:`)
# at a line's start. Linear: each try starts at a line and stops at its end.
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_.-]*[ \t]*(?:::=|:)", re.MULTILINE)


class _Flags(Protocol):
    grammar_max_chars: int
    grammar_max_rules: int
    max_tools: int
    tool_schema_max_chars: int


@dataclass(frozen=True)
class GrammarLimits:
    """The router's --grammar-max-chars, --grammar-max-rules, --max-tools and
    --tool-schema-max-chars (their help in config.py)."""

    max_chars: int = 64 * 1024
    max_rules: int = 512
    max_tools: int = 128
    max_tool_schema_chars: int = 16 * 1024

    @classmethod
    def of(cls, config: _Flags) -> GrammarLimits:
        return cls(
            config.grammar_max_chars,
            config.grammar_max_rules,
            config.max_tools,
            config.tool_schema_max_chars,
        )

    def text(self, param: str, text: str, rules: bool = False) -> None:
        """A grammar text as sent: at most max_chars characters and, for EBNF (`rules`),
        at most max_rules rule definitions."""
        if len(text) > self.max_chars:
            raise bad_request(
                f"'{param}' is {len(text)} characters; this server takes at most "
                f"{self.max_chars} (--grammar-max-chars)",
                param,
            )
        if rules:
            count = rule_count(text)
            if count > self.max_rules:
                raise bad_request(
                    f"'{param}' defines {count} rules; this server takes at most "
                    f"{self.max_rules} (--grammar-max-rules)",
                    param,
                )

    def schema(self, param: str, schema: Any) -> str:
        """`schema` as JSON text, at most max_chars characters."""
        text = _json(param, schema)
        self.text(param, text)
        return text

    def tool_schema(self, index: int, schema: Any) -> str:
        """Tool `index`'s parameters schema as JSON text, at most max_tool_schema_chars."""
        text = _json("tools", schema)
        if len(text) > self.max_tool_schema_chars:
            raise bad_request(
                f"'tools[{index}].function.parameters' is {len(text)} characters as JSON; "
                f"this server takes at most {self.max_tool_schema_chars} "
                f"(--tool-schema-max-chars)",
                "tools",
            )
        return text


def check_body(body: Any, limits: GrammarLimits) -> None:
    """The limits that need only a length: the count of `tools` (any API format) and the
    size of each grammar given as a string. Before the body is parsed; O(1) per field."""
    if not isinstance(body, dict):
        return  # the parser refuses it
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > limits.max_tools:
        raise bad_request(
            f"'tools' has {len(tools)} tools; this server takes at most {limits.max_tools} "
            f"(--max-tools)",
            "tools",
        )
    for name in _STRING_FIELDS:
        value = body.get(name)
        if isinstance(value, str):
            limits.text(name, value)
    nested = body.get("structured_outputs")
    if isinstance(nested, dict):
        for name in _NESTED_FIELDS:
            value = nested.get(name)
            if isinstance(value, str):
                limits.text("structured_outputs", value)


def rule_count(text: str) -> int:
    """How many rules `text` (GBNF or Lark) defines, counted by their heads; a bound, not a
    parse (a head inside a string literal counts too)."""
    return sum(1 for _ in _RULE.finditer(text))


def _json(param: str, value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except (TypeError, orjson.JSONEncodeError):  # nested too deep for the encoder
        raise bad_request(f"'{param}': the schema is nested too deeply", param) from None
