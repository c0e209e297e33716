"""The accepted-field tables are closed: any other field, stream option or message key is
a 400 naming it; fields accepted at a neutral value only are refused at any other; every
name of structured output becomes the request's one grammar; the chat template fields
change the rendered prompt as vLLM's do."""

from __future__ import annotations

import asyncio

import pytest

from libs.common.engine.load.source import default_model_path, load_tokenizer
from libs.common.engine.load.tokenizer import TextTokenizer
from libs.common.grammar.compiler import GrammarCompiler
from services.router.errors import ApiError
from services.router.formats.openai.validation import parse_request
from services.router.requests.prompts import prepare, render_chat
from services.router.structured import output as structured
from services.router.structured.limits import GrammarLimits

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": "m", "prompt": "hi"}
BODIES = {"chat": CHAT, "completions": COMP}


def refused(endpoint: str, body: dict, param: str) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_request(endpoint, body, max_n=4)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert param.split(".")[-1] in e.value.message
    return e.value


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    tok, _, _ = load_tokenizer(default_model_path())
    return tok


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("name", ["unknown_field", "cache_salt_typo", "bad_words", "Stop"])
def test_a_field_outside_the_table_is_400_naming_it(endpoint, name):
    refused(endpoint, {**BODIES[endpoint], name: 1}, name)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_stream_option_outside_the_table_is_400_naming_it(endpoint):
    body = {**BODIES[endpoint], "stream": True, "stream_options": {"include_usage": True, "x": 1}}
    refused(endpoint, body, "stream_options.x")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_beam_search", True), ("best_of", 2), ("best_of", True), ("length_penalty", 0.5),
        ("include_stop_str_in_output", True), ("skip_special_tokens", False),
        ("store", True), ("service_tier", "flex"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_neutral_only_field_is_refused_at_any_other_value(endpoint, field, value):
    refused(endpoint, {**BODIES[endpoint], field: value}, field)


def test_neutral_values_are_accepted():
    neutral = {"use_beam_search": False, "best_of": 1, "length_penalty": 1,
               "skip_special_tokens": True, "store": False, "service_tier": "auto"}  # fmt: skip
    for endpoint, body in BODIES.items():
        parse_request(endpoint, {**body, **neutral}, max_n=4)
    refused("chat", {**CHAT, "echo": True}, "echo")


def test_a_message_key_outside_its_roles_set_is_400_naming_it():
    messages = [{"role": "user", "content": "hi", "tool_calls": []}]
    refused("chat", {**CHAT, "messages": messages}, "messages[0].tool_calls")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "k": 1}]
    refused("chat", {**CHAT, "messages": messages}, "messages[1].k")


def test_reasoning_content_is_accepted_and_left_out_of_the_prompt(tokenizer):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "SECRET-THOUGHT"},
        {"role": "user", "content": "again", "name": "ann"},
    ]
    api = parse_request("chat", {**CHAT, "messages": messages}, max_n=1)
    assert "reasoning_content" not in api.messages[1]
    (prompt,) = prepare(api, tokenizer, max_model_len=1000)
    text = tokenizer.decode(prompt.token_ids)
    assert "hello" in text and "SECRET-THOUGHT" not in text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("structured_outputs", {"json": {"type": "object"}}),
        ("structured_outputs", {"json": '{"type": "integer"}'}),
        ("structured_outputs", {"regex": "[0-9]+"}),
        ("structured_outputs", {"choice": ["yes", "no"]}),
        ("structured_outputs", {"grammar": 'root ::= "a"'}),
        ("structured_outputs", {"json_object": True}),
        ("guided_json", {"type": "object"}), ("guided_regex", "[a-z]+"),
        ("guided_choice", ["red", "green"]), ("guided_grammar", 'root ::= "b"'),
    ],
)  # fmt: skip
def test_every_structured_output_name_becomes_the_one_grammar(field, value):
    for endpoint, body in BODIES.items():
        req = parse_request(endpoint, {**body, field: value}, 4)
        assert req.grammar is not None and req.grammar.param == field
        assert "grammar" not in req.sampling  # built off the loop by lifecycle.check


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_json": {}, "regex": "a"}, "guided_json"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["x"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["x"]}}, "structured_outputs"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 3]}, "guided_choice"),
    ],
)
def test_two_grammar_sources_or_a_malformed_one_are_400(extra, param):
    refused("completions", {**COMP, **extra}, param)


def test_a_choice_grammar_admits_exactly_its_choices(tokenizer, grammar_pool):
    compiler = GrammarCompiler(tokenizer.tokenizer.to_str(), tokenizer.vocab_size,
                               tokenizer.eos_token_ids)  # fmt: skip
    grammar = structured.from_body({"guided_choice": ['say "yes"', "no\\n"]})
    assert grammar is not None
    text = asyncio.run(structured.check(grammar, grammar_pool, GrammarLimits()))

    def accepts(text_: str) -> bool:
        matcher = compiler.matcher(text)
        ids = tokenizer.encode(text_, add_special=False)
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    assert accepts('say "yes"') and accepts("no\\n")
    assert not accepts("say yes") and not accepts("no")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"continue_final_message": True}, "continue_final_message"),  # last message is user's
        ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ],
)
def test_malformed_or_contradicting_template_fields_are_400(extra, param):
    refused("chat", {**CHAT, **extra}, param)


def test_continue_final_message_leaves_the_assistant_turn_open(tokenizer):
    messages = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "My favourite colour is"}]  # fmt: skip
    body = {**CHAT, "messages": messages, "continue_final_message": True}
    api = parse_request("chat", body, max_n=1)
    assert not api.template.add_generation_prompt
    text = render_chat(tokenizer, api.messages, None, api.template)
    assert text.endswith("My favourite colour is")
    closed = render_chat(tokenizer, api.messages)  # the turn closed, a new one opened
    assert closed.startswith(text) and len(closed) > len(text)


def test_add_generation_prompt_false_leaves_the_assistant_turn_unopened(tokenizer):
    api = parse_request("chat", {**CHAT, "add_generation_prompt": False}, max_n=1)
    opened = render_chat(tokenizer, api.messages)
    bare = render_chat(tokenizer, api.messages, None, api.template)
    assert opened.startswith(bare) and "assistant" in opened[len(bare) :]


def test_chat_template_kwargs_reach_the_template(tokenizer):
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tok = TextTokenizer(tokenizer.tokenizer, template, tokenizer.bos_token_id,
                        tokenizer.eos_token_ids, add_bos=False)  # fmt: skip
    body = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    api = parse_request("chat", body, max_n=1)
    assert render_chat(tok, api.messages, None, api.template) == "user: hi\n/no_think\nassistant:"
    plain = parse_request("chat", CHAT, max_n=1)
    assert render_chat(tok, plain.messages, None, plain.template) == "user: hi\nassistant:"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_priority_is_accepted_as_an_integer_and_refused_otherwise(endpoint):
    assert parse_request(endpoint, {**BODIES[endpoint], "priority": -7}, max_n=4).priority == -7
    assert parse_request(endpoint, BODIES[endpoint], max_n=4).priority == 0
    for bad in (1.5, "high", 2**31):
        refused(endpoint, {**BODIES[endpoint], "priority": bad}, "priority")
