"""The bounds on grammars and tools (services/router/structured/limits.py), checked before
anything is converted: each refusal a 400 naming the field and the flag; the rule count
and the Lark test linear where llguidance's own backtrack."""

from __future__ import annotations

import time

import pytest

from libs.common.grammar import build
from services.router.config import RouterConfig
from services.router.errors import ApiError
from services.router.structured.limits import GrammarLimits, check_body, rule_count
from tests.router.test_grammar_pool import chain

LIMITS = GrammarLimits(max_chars=1000, max_rules=10, max_tools=4, max_tool_schema_chars=50)


def _refused(call, *args) -> ApiError:
    with pytest.raises(ApiError) as e:
        call(*args)
    assert e.value.status == 400
    return e.value


def test_the_limits_are_the_routers_flags_with_their_defaults():
    assert GrammarLimits.of(RouterConfig()) == GrammarLimits()
    assert GrammarLimits() == GrammarLimits(64 * 1024, 512, 128, 16 * 1024)


@pytest.mark.parametrize("flag", ["grammar_max_chars", "grammar_max_rules", "max_tools",
                                  "tool_schema_max_chars", "grammar_workers",
                                  "grammar_timeout"])  # fmt: skip
def test_a_limit_flag_below_one_is_refused_naming_it(flag):
    with pytest.raises(ValueError, match=flag.replace("_", "-")):
        RouterConfig(**{flag: 0}).validate()


def test_tools_over_the_count_are_400_before_any_is_read():
    err = _refused(check_body, {"tools": [None] * 5}, LIMITS)  # items not even objects
    assert err.param == "tools" and "--max-tools" in err.message and "5" in err.message
    check_body({"tools": [None] * 4}, LIMITS)  # at the limit: left to the parser


@pytest.mark.parametrize("field", ["regex", "ebnf", "guided_regex", "guided_grammar",
                                   "guided_json"])  # fmt: skip
def test_a_grammar_string_over_the_size_is_400_naming_its_field(field):
    err = _refused(check_body, {field: "a" * 1001}, LIMITS)
    assert err.param == field and "--grammar-max-chars" in err.message
    check_body({field: "a" * 1000}, LIMITS)


@pytest.mark.parametrize("key", ["regex", "grammar", "json"])
def test_a_structured_outputs_string_over_the_size_is_400(key):
    err = _refused(check_body, {"structured_outputs": {key: "a" * 1001}}, LIMITS)
    assert err.param == "structured_outputs" and "--grammar-max-chars" in err.message


def test_a_schema_is_measured_as_json_text():
    small = {"type": "string"}
    assert LIMITS.schema("response_format", small) == '{"type":"string"}'
    err = _refused(LIMITS.schema, "response_format", {"description": "d" * 1000})
    assert err.param == "response_format" and "--grammar-max-chars" in err.message


def test_a_tool_schema_over_its_size_is_400_naming_the_tool():
    err = _refused(LIMITS.tool_schema, 3, {"description": "d" * 50})
    assert err.param == "tools" and "tools[3]" in err.message
    assert "--tool-schema-max-chars" in err.message


@pytest.mark.parametrize(
    ("text", "rules"),
    [
        ('root ::= "a" b\nb ::= "b"\n', 2),
        ('root ::= x\n  | y\nx ::= "x"\ny ::= "y"', 3),  # a continuation is not a rule
        ('start: a+\n?a: "a" | B\nB.2: /b/\n%ignore " "\n', 3),  # Lark: ?rule, TERM.priority
        ("\n" * 100 + 'root ::= "a"', 1),
        ('root ::= "a ::= b"', 1),  # one head per line
    ],
)
def test_rules_are_counted_by_their_heads(text, rules):
    assert rule_count(text) == rules


def test_an_ebnf_grammar_over_the_rule_count_is_400_naming_the_flag():
    LIMITS.text("ebnf", chain(9), rules=True)  # root and 9 more: 10
    err = _refused(LIMITS.text, "ebnf", chain(10), True)
    assert err.param == "ebnf" and "11 rules" in err.message
    assert "--grammar-max-rules" in err.message


def test_counting_and_lark_detection_stay_linear_on_blank_lines_and_long_names():
    """llguidance's own Lark test takes seconds on 16 KiB of newlines (quadratic)."""
    blank = "\n" * (256 * 1024) + 'root ::= "yes"\n'
    name = "a" * (256 * 1024) + "\n" + " " * (256 * 1024) + 'root ::= "yes"\n'
    started = time.perf_counter()
    assert rule_count(blank) == 1 and rule_count(name) == 1
    assert build._LARK.search(blank) is None and build._LARK.search(name) is None
    assert build._LARK.search("\n" * 1000 + "  start: x") is not None
    assert time.perf_counter() - started < 1.0  # quadratic would be minutes
