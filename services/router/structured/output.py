"""Structured output in the API, under every name clients send it -> one grammar.

OpenAI's `response_format` (text, json_object, json_schema), SGLang's `regex` and `ebnf`,
vLLM's `structured_outputs` ({json | regex | choice | grammar | json_object}) and its
older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar` each ask for a
grammar; a request may ask for one at most (tools with tool_choice required
or a named function are a grammar too: services/router/structured/tools/request.py). The
grammar text is
built here without a tokenizer (libs/common/grammar/build.py); `check` then compiles it
against the model's tokenizer off the event loop, through the router's grammar cache, so
a schema, regex or grammar that cannot be enforced is a 400 naming its field before any
worker is asked. The workers compile the same text again, from their own cache.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from libs.common.engine.core.sampling_params import MAX_GRAMMAR_CHARS
from libs.common.grammar import build
from libs.common.grammar.build import GrammarError
from libs.common.grammar.compiler import GrammarCompiler
from services.router.errors import bad_request

FIELDS = (
    "response_format", "regex", "ebnf", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
)  # fmt: skip
# vLLM's structured_outputs keys (and guided_<key>): what each asks for.
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Grammar:
    """A request's grammar: its text (llguidance's format) and the field that asked."""

    text: str
    param: str


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
            text = _response_format(value)
        elif param == "structured_outputs":
            text = _structured_outputs(value)
        elif param.startswith("guided_"):
            text = _kind(param.removeprefix("guided_"), value, param)
        elif param == "regex":
            text = build.regex(value, param)
        else:
            text = build.ebnf(value, param)
    except GrammarError as e:
        raise _refused(e) from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"'{param}' is over {MAX_GRAMMAR_CHARS} characters as a grammar", param)
    return Grammar(text, param)


async def check(grammar: Grammar, compiler: GrammarCompiler) -> None:
    """Compile `grammar` (or find it compiled); a 400 naming its field when it fails."""
    try:
        await compiler.check_async(grammar.text, grammar.param)
    except GrammarError as e:
        raise _refused(e) from None


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


def _structured_outputs(value: Any) -> str:
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


def _kind(kind: str, value: Any, param: str) -> str:
    """The grammar of one structured-output kind, its errors naming `param`."""
    if kind == "json":
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except ValueError:
                raise GrammarError(param, f"'{param}': the schema is not valid JSON") from None
        return build.json_schema(value, param)
    if kind == "json_object":
        if value is not True:
            raise GrammarError(param, f"'{param}.json_object' must be true")
        return build.json_object(param)
    if kind == "regex":
        return build.regex(value, param)
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise GrammarError(param, f"'{param}': a choice is a non-empty list of strings")
        if not all(isinstance(c, str) and c for c in value):
            raise GrammarError(param, f"'{param}': each choice must be a non-empty string")
        # Lark string literals are JSON's: one alternative per choice, exactly its text.
        return build.lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    return build.ebnf(value, param)  # grammar


def _response_format(value: Any) -> str:
    param = "response_format"
    if not isinstance(value, dict):
        raise GrammarError(param, "'response_format' must be an object")
    kind = value.get("type")
    if kind == "json_object":
        return build.json_object(param)
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
    return build.json_schema(spec["schema"], param)
