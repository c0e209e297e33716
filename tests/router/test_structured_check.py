"""A grammar the router cannot enforce is a 400 naming its field, found by compiling it
against the real default model's tokenizer in the grammar pool; distinct grammars compile
once."""

from __future__ import annotations

import asyncio

import pytest

from libs.common.grammar.pool import GrammarPool
from services.router.errors import ApiError
from services.router.structured import output as structured
from services.router.structured.limits import GrammarLimits


@pytest.fixture(scope="module")
def compiler(grammar_pool) -> GrammarPool:
    return grammar_pool


def _schema(schema) -> dict:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    }


def _check(body: dict, pool: GrammarPool) -> None:
    grammar = structured.from_body(body)
    assert grammar is not None
    asyncio.run(structured.check(grammar, pool, GrammarLimits()))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_schema({"type": "foo"}), "response_format"),
        (_schema({"type": "string", "format": "no-such-format"}), "response_format"),
        (_schema({"properties": {"a": {"$ref": "#/nowhere"}}}), "response_format"),
        ({"regex": "[a-"}, "regex"),
        ({"regex": "(unclosed"}, "regex"),
        (_schema({"type": "array", "uniqueItems": True}), "response_format"),
        (_schema({"not": {"type": "string"}}), "response_format"),
        ({"ebnf": 'root ::= "a" ('}, "ebnf"),
        ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
        ({"ebnf": "start: x"}, "ebnf"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ],
)  # fmt: skip
def test_a_grammar_that_cannot_be_enforced_is_400_naming_its_field(body, param, compiler):
    with pytest.raises(ApiError) as e:
        _check(body, compiler)
    assert e.value.status == 400 and e.value.param == param
    assert param in e.value.message


@pytest.mark.parametrize(
    "body",
    [
        _schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
        {"response_format": {"type": "json_object"}},
        {"regex": r"\d{4}-\d{2}-\d{2}"},
        {"ebnf": 'root ::= "yes" | "no"'},
        {"ebnf": 'start: "a"+'},
    ],
)
def test_a_grammar_that_compiles_is_accepted(body, compiler):
    _check(body, compiler)


def test_the_same_grammar_is_compiled_once_for_every_request(compiler):
    body = {"regex": "(red|green|blue) [0-9]{3}"}
    before = compiler.jobs
    for _ in range(5):
        _check(body, compiler)
    assert compiler.jobs == before + 1
