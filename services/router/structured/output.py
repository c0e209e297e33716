"""Structured output in the API, under every name clients send it -> one grammar.

OpenAI's `response_format` (text, json_object, json_schema), SGLang's `regex` and `ebnf`,
vLLM's `structured_outputs` ({json | regex | choice | grammar | json_object}) and its
older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar` each ask for a
grammar; a request may ask for one at most (tools with tool_choice required or a named
function are a grammar too: services/router/structured/tools/request.py).

`from_body` only reads what is asked (a `Grammar`: the field, its kind, its source), on
the event loop, in time bounded by the body's shape. `check` then does the rest off the
loop: the source's size and rule count against the limits (limits.py), in a thread; the
conversion to llguidance's format (libs/common/grammar/build.py) and the compile against
the model's tokenizer, in a worker process of the grammar pool with a deadline
(libs/common/grammar/pool.py), cached by a hash of the source. So a schema, regex or
grammar that cannot be enforced, or is too big or too slow to, is a 400 naming its field
before any worker is asked. The workers compile the same text again, from their own cache.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

from libs.common.engine.core.sampling_params import MAX_GRAMMAR_CHARS
from libs.common.grammar.build import GrammarError
from libs.common.grammar.pool import GrammarPool, GrammarPoolBusy
from services.router.errors import bad_request, busy
from services.router.structured.limits import GrammarLimits

FIELDS = (
    "response_format", "regex", "ebnf", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
)  # fmt: skip
# vLLM's structured_outputs keys (and guided_<key>): what each asks for.
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class Grammar:
    """A request's grammar as asked, not yet built: the field that asked (`param`), its
    `kind` and `source`:
      json    a JSON schema (a dict or a boolean), or one as JSON text (vLLM's guided_json)
      choice  a list of strings, one of which is the output
      regex   a pattern (Rust's regex syntax)
      ebnf    a grammar text, GBNF or Lark
      tools   the forced tool calls of the request's ToolRequest (source None)
    """

    param: str
    kind: str
    source: Any = None


def from_body(body: dict[str, Any]) -> Grammar | None:
    """The grammar `body` asks for, or None; a 400 naming the field when it is malformed
    or when more than one field asks for one."""
    asked = [name for name in FIELDS if _asks(name, body.get(name))]
    if len(asked) > 1:
        raise bad_request(
            f"one grammar per request: {' and '.join(repr(a) for a in asked)} both ask for one",
            asked[1],
        )
    if not asked:
        return None
    param = asked[0]
    value = body[param]
    try:
        if param == "response_format":
            return _response_format(value)
        if param == "structured_outputs":
            return _structured_outputs(value)
        if param.startswith("guided_"):
            return _kind(param.removeprefix("guided_"), value, param)
        return _kind("regex" if param == "regex" else "grammar", value, param)
    except GrammarError as e:
        raise _refused(e) from None


async def check(grammar: Grammar, pool: GrammarPool, limits: GrammarLimits) -> str:
    """The grammar's text, built and compiled (or found so) off the event loop; a 400
    naming its field when it is over a limit, cannot be enforced or takes too long."""
    items, key = await asyncio.to_thread(_items, grammar, limits)
    try:
        (text,) = await pool.run(key, grammar.param, items)
    except GrammarError as e:
        raise _refused(e) from None
    except GrammarPoolBusy as e:
        raise busy(f"the grammar checker is busy ({e}); try again") from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad_request(
            f"'{grammar.param}' is over {MAX_GRAMMAR_CHARS} characters as a grammar",
            grammar.param,
        )
    return text


def _items(grammar: Grammar, limits: GrammarLimits) -> tuple[list[tuple[str, str]], str]:
    """A grammar's source as the pool's one item, within the limits, and its key (in a
    thread: O(the source))."""
    source = grammar.source
    if isinstance(source, str):
        limits.text(grammar.param, source, rules=grammar.kind == "ebnf")
        text = source
    else:  # a schema or a list of choices, as JSON text
        text = limits.schema(grammar.param, source)
    items = [(grammar.kind, text)]
    return items, GrammarPool.key(items)


def _refused(e: GrammarError) -> Exception:
    """The 400 for a grammar that cannot be enforced; its message names the field."""
    message = str(e) if f"'{e.param}" in str(e) else f"'{e.param}': {e}"
    return bad_request(message, e.param)


def _asks(name: str, value: Any) -> bool:
    if value is None:
        return False
    if name == "response_format":
        return not (isinstance(value, dict) and value.get("type") == "text")
    if name == "structured_outputs":  # {} and all-null keys ask for nothing
        return not isinstance(value, dict) or any(v is not None for v in value.values())
    return True


def _structured_outputs(value: Any) -> Grammar:
    """vLLM's `structured_outputs`: exactly one of _KINDS set."""
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise GrammarError(param, f"'{param}' must be an object")
    for key in sorted(value):
        if key not in _KINDS:
            raise GrammarError(
                param, f"'{param}.{key}' is not supported (one of {', '.join(_KINDS)})"
            )
    asked = [k for k in _KINDS if value.get(k) is not None and value.get(k) is not False]
    if len(asked) != 1:
        raise GrammarError(param, f"'{param}' must set exactly one of {', '.join(_KINDS)}")
    return _kind(asked[0], value[asked[0]], param)


def _kind(kind: str, value: Any, param: str) -> Grammar:
    """What one structured-output kind asks for, its errors naming `param`."""
    if kind == "json":  # vLLM takes the schema as JSON text too
        if not isinstance(value, dict | bool | str):
            raise GrammarError(param, "a JSON schema must be an object or a boolean")
        return Grammar(param, "json", value)
    if kind == "json_object":
        if value is not True:
            raise GrammarError(param, f"'{param}.json_object' must be true")
        return Grammar(param, "json", _ANY_OBJECT)
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise GrammarError(param, f"'{param}': a choice is a non-empty list of strings")
        if not all(isinstance(c, str) and c for c in value):
            raise GrammarError(param, f"'{param}': each choice must be a non-empty string")
        return Grammar(param, "choice", value)
    if not isinstance(value, str) or not value or value.isspace():
        raise GrammarError(param, f"'{param}' must be a non-empty string")
    return Grammar(param, "regex" if kind == "regex" else "ebnf", value)


def _response_format(value: Any) -> Grammar:
    param = "response_format"
    if not isinstance(value, dict):
        raise GrammarError(param, "'response_format' must be an object")
    kind = value.get("type")
    if kind == "json_object":
        return Grammar(param, "json", _ANY_OBJECT)
    if kind != "json_schema":
        raise GrammarError(
            param, "'response_format.type' must be one of 'text', 'json_object', 'json_schema'"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise GrammarError(param, "'response_format.json_schema' must be an object")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise GrammarError(
            param, "'response_format.json_schema.name' must be 1-64 of a-z, A-Z, 0-9, _ and -"
        )
    if not isinstance(spec.get("strict", False), bool):
        raise GrammarError(param, "'response_format.json_schema.strict' must be a boolean")
    if "schema" not in spec:
        raise GrammarError(param, "'response_format.json_schema.schema' is required")
    if not isinstance(spec["schema"], dict | bool):
        raise GrammarError(param, "a JSON schema must be an object or a boolean")
    return Grammar(param, "json", spec["schema"])
