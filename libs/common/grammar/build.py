"""Request fields -> one grammar text in llguidance's format (a JSON string or Lark).

Every function returns the text the workers compile; nothing here needs a tokenizer, so a
malformed schema is found when it is compiled (compiler.py). GrammarError carries the API
parameter to name in the 400.

JSON is generated compactly: ", " between items, ": " after keys and no other whitespace,
so a sampled answer cannot wander into unbounded whitespace (docs/structured_output.md).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in the stub only

# Lark, not GBNF: a line that starts (after blanks) with %llguidance or the rule `start:`.
# llguidance's own test (is_lark_syntax) lets `^\s*` run across newlines, which backtracks
# quadratically over blank lines (16 KiB of newlines: seconds); this one stops at each line.
_LARK = re.compile(r"^[^\S\n]*(?:%llguidance\b|start\s*:)", re.MULTILINE)

JSON_OPTIONS: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}


class GrammarError(ValueError):
    """A grammar the server cannot enforce; `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def json_schema(schema: Any, param: str = "response_format") -> str:
    """A grammar for JSON values valid against `schema` (a dict or a boolean)."""
    if not isinstance(schema, dict | bool):
        raise GrammarError(param, "a JSON schema must be an object or a boolean")
    try:
        # The stub says str | dict; the compiler takes the boolean schemas true and false too.
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema,  # type: ignore[arg-type]
            overrides=JSON_OPTIONS,
        )
    except ValueError as e:
        raise GrammarError(param, f"invalid JSON schema: {e}") from None


def json_object(param: str = "response_format") -> str:
    """Any JSON object (OpenAI's `{"type": "json_object"}`)."""
    return json_schema({"type": "object"}, param)


def regex(pattern: Any, param: str = "regex") -> str:
    """Text that fully matches `pattern` (llguidance's regex syntax, Rust's `regex`)."""
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError(param, f"'{param}' must be a non-empty string")
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def ebnf(text: Any, param: str = "ebnf") -> str:
    """An EBNF grammar: GBNF (`root ::= ...`, llama.cpp's and SGLang's) or Lark."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(param, f"'{param}' must be a non-empty string")
    try:
        lark = text if _LARK.search(text) else gbnf_to_lark(text)
    except Exception as e:  # the converter raises its own errors and plain ones
        raise GrammarError(param, f"invalid EBNF grammar: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def lark(text: str) -> str:
    """A Lark grammar as written (llguidance's dialect, with %json { schema } rules)."""
    return llguidance.LLMatcher.grammar_from_lark(text)


def json_rule(schema: dict[str, Any]) -> str:
    """`schema` as an inline Lark rule body: `%json { ... }`, compact like json_schema()."""
    body = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **JSON_OPTIONS}}
    return "%json " + json.dumps(body, separators=(",", ":"))


KINDS = ("json", "choice", "regex", "ebnf", "lark", "grammar")


def from_source(kind: str, source: str, param: str) -> str:
    """The grammar text of a source given as text, by `kind`:
      json     a JSON schema as JSON text          choice   a JSON list of strings
      regex    a pattern                           ebnf     GBNF or Lark
      lark     Lark as written                     grammar  a grammar text (as is)
    Blocking and O(the source) or worse: never on an event loop (pool.py runs it)."""
    if kind == "json":
        try:
            schema = json.loads(source)
        except ValueError:
            raise GrammarError(param, f"'{param}': the schema is not valid JSON") from None
        return json_schema(schema, param)
    if kind == "choice":
        choices = json.loads(source)
        # Lark string literals are JSON's: one alternative per choice, exactly its text.
        return lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    if kind == "regex":
        return regex(source, param)
    if kind == "ebnf":
        return ebnf(source, param)
    if kind == "lark":
        return lark(source)
    if kind == "grammar":
        return source
    raise GrammarError(param, f"unknown grammar kind {kind!r}")
