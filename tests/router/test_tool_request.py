"""Tool calling, the request side (services/router/structured/tools/request.py): the
request's 400s, the forcing grammar against the real default model's tokenizer, and the
fallback rendering through its ChatML template (the output side: test_tool_parse.py)."""

from __future__ import annotations

import asyncio
import json

import jinja2
import pytest

from libs.common.engine.load.source import default_model_path, load_tokenizer
from libs.common.grammar.compiler import GrammarCompiler
from libs.common.grammar.pool import GrammarPool
from services.router.errors import ApiError
from services.router.structured.limits import GrammarLimits
from services.router.structured.tools import request as tools
from services.router.structured.tools.grammar import (
    MAX_PARALLEL_CALLS,
    check_tool_grammar,
    tool_grammar,
)
from tests.router.tool_cases import TIME, WEATHER, call_block, tool_request

SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tool(name: str, parameters: dict | None = None, **extra) -> dict:
    function = {"name": name, "description": f"{name} tool", **extra}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


TOOLS = [_tool("get_weather", WEATHER), _tool("get_time", TIME)]


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture(scope="module")
def tokenizer():
    tok, _, _ = load_tokenizer(default_model_path())
    return tok


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(
        tokenizer.tokenizer.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids
    )


def _refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as e:
        tools.parse_tools(body)
    assert e.value.status == 400
    return e.value


# --- parse_tools ------------------------------------------------------------------------


def test_no_tools_and_no_choice_is_no_tool_request():
    assert tools.parse_tools({}) is None
    assert tools.parse_tools({"tools": [], "tool_choice": "none"}) is None


def test_tools_without_a_choice_default_to_auto_and_parallel():
    req = tools.parse_tools({"tools": TOOLS})
    assert req is not None and req.choice == "auto" and req.parallel is True
    assert [t.name for t in req.tools] == ["get_weather", "get_time"]
    assert req.tools[0].parameters == WEATHER


def test_a_tool_without_parameters_takes_any_object():
    req = tools.parse_tools({"tools": [_tool("ping")]})
    assert req.tools[0].parameters == {"type": "object", "properties": {}}


def test_a_named_function_choice_is_kept_with_its_name():
    body = {
        "tools": TOOLS,
        "tool_choice": _named("get_time"),
        "parallel_tool_calls": False,
    }
    req = tools.parse_tools(body)
    assert (req.choice, req.function, req.parallel) == ("function", "get_time", False)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [{"type": "code", "function": {"name": "a"}}]}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"tools": [_tool("bad name")]}, "tools"),
        ({"tools": [_tool("x" * 65)]}, "tools"),
        ({"tools": [_tool("a"), _tool("a")]}, "tools"),
        ({"tools": [_tool("a", [1, 2])]}, "tools"),
        ({"tools": [_tool("a", {"type": "string"})]}, "tools"),
        ({"tools": [_tool("a", strict="yes")]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": _named("nope")}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": _named("get_time")}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"functions": [{"name": "a"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
    ],
)  # fmt: skip
def test_a_malformed_tool_field_is_400_naming_it(body, param):
    error = _refused(body)
    assert error.param == param


def test_legacy_fields_point_to_their_replacements():
    assert "tools" in _refused({"functions": [{"name": "a"}]}).message
    assert "tool_choice" in _refused({"function_call": {"name": "a"}}).message


# --- check_tool_messages ----------------------------------------------------------------


def _call(arguments: str = '{"city": "Paris"}', **extra) -> dict:
    function = {"name": "get_weather", "arguments": arguments}
    return {"id": "call_1", "type": "function", "function": function, **extra}


def test_a_well_formed_tool_history_passes():
    tools.check_tool_messages(
        [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [_call()]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    )


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": "", "tool_calls": {"id": "x"}},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]},
        {"role": "assistant", "content": "", "tool_calls": [_call(type="code")]},
        {"role": "assistant", "content": "", "tool_calls": [{**_call(), "function": "f"}]},
        {"role": "assistant", "content": "", "tool_calls": [_call(arguments={"city": "P"})]},
        {"role": "assistant", "content": "", "tool_calls": [_call(arguments="{not json")]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "sunny", "tool_call_id": 7},
    ],
)
def test_a_malformed_tool_message_is_400_naming_its_index(message):
    with pytest.raises(ApiError) as e:
        tools.check_tool_messages([{"role": "user", "content": "hi"}, message])
    assert e.value.status == 400 and e.value.param == "messages"
    assert "messages[1]" in e.value.message


# --- tool_grammar -----------------------------------------------------------------------


def _accepts(compiler, tokenizer, grammar: str, text: str) -> bool:
    matcher = compiler.matcher(grammar)
    ids = tokenizer.encode(text, add_special=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_auto_and_none_have_no_grammar():
    assert tool_grammar(tool_request("auto")) is None
    assert tool_grammar(tool_request("none")) is None


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize(("choice", "function"), [("required", None), ("function", "get_time")])
def test_forcing_grammars_compile(choice, function, parallel, compiler):
    compiler.check(tool_grammar(tool_request(choice, function, parallel)), "tools")


@pytest.mark.parametrize(
    "text",
    [
        call_block("get_weather", {"city": "Paris"}),
        call_block("get_weather", {"city": "Paris", "days": 3}),
        call_block("get_time", {"zone": "UTC"}),
        call_block("get_time", {"zone": "UTC"})
        + "\n"
        + call_block("get_weather", {"city": "Oslo"}),
    ],
)
def test_required_grammar_accepts_calls_to_any_tool(text, compiler, tokenizer):
    assert _accepts(compiler, tokenizer, tool_grammar(tool_request("required")), text)


@pytest.mark.parametrize(
    "text",
    [
        call_block("get_weather", {"city": 7}),  # a type mismatch
        call_block("get_weather", {"days": 3}),  # a required argument missing
        call_block("get_news", {"city": "Paris"}),  # no such function
        "Sure! " + call_block("get_time", {"zone": "UTC"}),  # content first
        '<tool_call>\n{"name": "get_time"}\n</tool_call>',  # no arguments
    ],
)
def test_required_grammar_refuses_anything_but_valid_calls(text, compiler, tokenizer):
    assert not _accepts(compiler, tokenizer, tool_grammar(tool_request("required")), text)


def test_a_named_function_grammar_refuses_the_other_tools(compiler, tokenizer):
    grammar = tool_grammar(tool_request("function", "get_time"))
    assert _accepts(compiler, tokenizer, grammar, call_block("get_time", {"zone": "CET"}))
    assert not _accepts(compiler, tokenizer, grammar, call_block("get_weather", {"city": "Rome"}))


def test_without_parallel_calls_the_grammar_takes_exactly_one(compiler, tokenizer):
    one = call_block("get_time", {"zone": "UTC"})
    serial = tool_grammar(tool_request("required", parallel=False))
    assert _accepts(compiler, tokenizer, serial, one)
    assert not _accepts(compiler, tokenizer, serial, one + "\n" + one)


def test_forced_parallel_calls_are_bounded(compiler, tokenizer):
    one = call_block("get_time", {"zone": "UTC"})
    grammar = tool_grammar(tool_request("required"))
    most = "\n".join([one] * MAX_PARALLEL_CALLS)
    assert _accepts(compiler, tokenizer, grammar, most)
    assert not _accepts(compiler, tokenizer, grammar, most + "\n" + one)


def test_a_named_function_is_called_once(compiler, tokenizer):
    one = call_block("get_time", {"zone": "UTC"})
    grammar = tool_grammar(tool_request("function", "get_time"))
    assert not _accepts(compiler, tokenizer, grammar, one + "\n" + one)


def _check(req: tools.ToolRequest, pool: GrammarPool) -> str | None:
    return asyncio.run(check_tool_grammar(req, pool, GrammarLimits()))


def test_an_unenforceable_parameters_schema_is_400_naming_tools(grammar_pool):
    body = {"tools": [_tool("b", TIME), _tool("a", {"type": "foo"})], "tool_choice": "auto"}
    req = tools.parse_tools(body)
    assert req is not None
    with pytest.raises(ApiError) as e:
        _check(req, grammar_pool)
    assert e.value.status == 400 and e.value.param == "tools"
    assert "tools[1]" in e.value.message


def test_enforceable_tools_pass_the_grammar_check_and_forced_ones_give_their_grammar(
    grammar_pool,
):
    forced = tool_request("required")
    assert _check(forced, grammar_pool) == tool_grammar(forced)
    assert _check(tool_request("auto"), grammar_pool) is None


def test_a_parameters_schema_over_the_limit_is_400_naming_its_tool(grammar_pool):
    big = {"type": "object", "description": "x" * 100}
    req = tools.parse_tools({"tools": [_tool("a", TIME), _tool("b", big)]})
    assert req is not None
    with pytest.raises(ApiError) as e:
        asyncio.run(check_tool_grammar(req, grammar_pool, GrammarLimits(
            max_tool_schema_chars=100)))  # fmt: skip
    assert e.value.param == "tools" and "tools[1]" in e.value.message
    assert "--tool-schema-max-chars" in e.value.message


def test_a_name_given_twice_is_400_also_among_many_tools():
    many = [_tool(f"f{i}") for i in range(2000)]
    err = _refused({"tools": [*many, _tool("f1999")]})
    assert err.param == "tools" and "tools[2000]" in err.message


# --- prompt and rendering ---------------------------------------------------------------


def _render(messages: list[dict]) -> str:
    return jinja2.Template(SMOL_TEMPLATE).render(messages=messages, add_generation_prompt=True)


def test_template_has_tools_looks_inside_jinja_tags_only():
    assert tools.template_has_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not tools.template_has_tools(SMOL_TEMPLATE)
    assert not tools.template_has_tools("I use tools {{ messages }}")
    assert not tools.template_has_tools(None)


def test_the_tools_prompt_lists_every_tool_and_the_call_format():
    prompt = tools.tools_prompt(tool_request("required"))
    assert "<tool_call>" in prompt and "</tool_call>" in prompt
    for line in (json.dumps(t.openai()) for t in tool_request().tools):
        assert line in prompt
    assert "must call" in prompt


def test_a_template_with_tools_gets_them_as_a_keyword_and_parsed_arguments():
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [_call()]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out, kwargs = tools.render_messages(messages, tool_request(), True)
    assert kwargs == {"tools": [t.openai() for t in tool_request().tools]}
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert out[1]["tool_calls"][0]["id"] == "call_1" and out[2] == messages[2]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


def test_the_fallback_prepends_the_tools_prompt_to_the_system_message():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    out, kwargs = tools.render_messages(messages, tool_request(), False)
    assert kwargs == {} and len(out) == 2
    assert out[0]["content"] == tools.tools_prompt(tool_request()) + "\n\nBe brief."


def test_the_fallback_adds_a_system_message_when_there_is_none():
    out, _ = tools.render_messages([{"role": "user", "content": "hi"}], tool_request(), False)
    assert out[0] == {"role": "system", "content": tools.tools_prompt(tool_request())}
    assert "SmolLM" not in _render(out)


OSLO = '{"city": "Oslo"}'


def test_the_fallback_renders_a_tool_history_as_chatml_text():
    messages = [
        {"role": "user", "content": "weather and time?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [_call(), _call(OSLO)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": "Sunny in Paris, rain in Oslo."},
    ]
    out, kwargs = tools.render_messages(messages, None, False)
    assert kwargs == {} and [m["role"] for m in out] == ["user", "assistant", "user", "assistant"]
    assert all(set(m) == {"role", "content"} for m in out)
    text = _render(out)
    assert (
        '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Oslo"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n"
    ) in text
    assert "You can call functions" not in text  # no request: no tools prompt


def test_tool_choice_none_adds_no_tools_prompt_either_way():
    messages = [{"role": "user", "content": "hi"}]
    assert tools.render_messages(messages, tool_request("none"), False) == (messages, {})
    assert tools.render_messages(messages, tool_request("none"), True) == (messages, {})


def test_a_past_call_renders_in_the_format_the_grammar_forces(compiler, tokenizer):
    messages = [{"role": "assistant", "content": None, "tool_calls": [_call()]}]
    out, _ = tools.render_messages(messages, None, False)
    grammar = tool_grammar(tool_request("required"))
    assert _accepts(compiler, tokenizer, grammar, out[0]["content"])


@pytest.mark.parametrize("has_tools", [True, False])
def test_rendering_leaves_the_callers_messages_unchanged(has_tools):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": None, "tool_calls": [_call()]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    before = json.dumps(messages)
    out, _ = tools.render_messages(messages, tool_request(), has_tools)
    assert json.dumps(messages) == before
    assert all(isinstance(m["content"], str) for m in out)
