"""Reasoning models (services/router/structured/reasoning.py, requests/chat_text.py): which
model thinks, where its output starts after a prompt, the thinking split out of the
answer whole and streamed, and a grammar that applies only after `</think>` (checked with
llguidance's matcher on the tiny Qwen3 tokenizer of tests/router/tiny_qwen3.py). The
server end to end: test_reasoning_e2e.py."""

from __future__ import annotations

import llguidance
import pytest

from libs.common.engine.core.sampling_params import MAX_GRAMMAR_CHARS
from libs.common.engine.load.source import default_model_path, load_tokenizer
from libs.common.engine.load.tokenizer import TextTokenizer
from libs.common.grammar import build
from services.router.errors import ApiError
from services.router.formats.openai import shapes as fmt
from services.router.formats.openai.validation import ApiRequest, parse_request
from services.router.requests.chat_text import ChatText, chat_choice
from services.router.requests.prompts import prepare
from services.router.structured.reasoning import (
    ThinkTags,
    after_thinking,
    output_start,
    split_reasoning,
    think_tags,
)
from services.router.structured.tools.grammar import tool_grammar
from tests.router import tiny_qwen3
from tests.router.tool_cases import call_block, tool_request

USER = [{"role": "user", "content": "Hello"}]


def qwen(think_tokens: bool = True) -> TextTokenizer:
    tok = tiny_qwen3.tokenizer(think_tokens)
    eos = (tok.token_to_id("<|im_end|>"),)
    return TextTokenizer(tok, tiny_qwen3.TEMPLATE, None, eos, add_bos=False)


# --- which model thinks, and where its output starts --------------------------------------


def test_a_model_thinks_when_its_tokenizer_or_its_template_has_the_tags():
    tok = qwen()
    ids = tok.tokenizer.token_to_id("<think>"), tok.tokenizer.token_to_id("</think>")
    assert think_tags(tok) == ThinkTags(*ids, tok.eos_token_ids)
    assert think_tags(qwen(think_tokens=False)) == ThinkTags(None, None, tok.eos_token_ids)
    default, _, _ = load_tokenizer(default_model_path())
    assert think_tags(default) is None


def test_the_rendered_prompt_says_where_the_output_starts():
    tok = qwen()
    tags = think_tags(tok)
    thinking_on = tok.apply_chat_template(USER)
    thinking_off = tok.apply_chat_template(USER, enable_thinking=False)
    assert output_start(tags, thinking_on) == "maybe"
    assert output_start(tags, thinking_off) is None  # Qwen3's empty thinking, closed
    assert output_start(tags, thinking_on + "<think>\n") == "thinking"
    assert output_start(None, thinking_on + "<think>\n") is None


# --- the output split: reasoning and answer ----------------------------------------------

SPLITS = [
    ("maybe", "<think>\nLet me see.\n</think>\n\nHi there.", "Let me see.", "Hi there."),
    ("maybe", "  <think>a</think>b", "a", "b"),
    ("maybe", "Hi, no thinking.", "", "Hi, no thinking."),
    ("maybe", "<thinking is a word", "", "<thinking is a word"),
    ("maybe", "<think>cut while thinking </thi", "cut while thinking </thi", ""),
    ("thinking", "\ninside\n</think>\n\nanswer </think>", "inside", "answer </think>"),
    ("thinking", "never closed  ", "never closed", ""),
    ("maybe", "<think></think>\n\n", "", ""),
]  # fmt: skip


@pytest.mark.parametrize(("start", "text", "reasoning", "answer"), SPLITS)
def test_the_thinking_is_split_out_of_the_answer(start, text, reasoning, answer):
    assert split_reasoning(text, start) == (reasoning, answer)


@pytest.mark.parametrize(("start", "text"), [(s[0], s[1]) for s in SPLITS])
@pytest.mark.parametrize("size", [1, 2, 5])
def test_the_streamed_split_adds_up_to_the_whole_one(start, text, size):
    stream = ChatText(None, start)
    events = [stream.event(0, text[i : i + size], None, None) for i in range(0, len(text), size)]
    events.append(stream.event(0, "", None, "stop"))
    deltas = [e["delta"] for e in events if e is not None]
    streamed = tuple(
        "".join(d.get(k, "") for d in deltas) for k in ("reasoning_content", "content")
    )
    assert streamed == split_reasoning(text, start)
    assert all(deltas[:-1]), "an empty delta was sent"


def test_a_cut_output_drops_a_partial_closing_tag():
    assert split_reasoning("<think>hm </thi", "maybe", cut=True) == ("hm", "")


def test_a_finished_choice_has_reasoning_content_and_calls_only_from_the_answer():
    inner = call_block("get_time", {"zone": "A"})
    text = f"<think>maybe {inner}</think>\n" + call_block("get_weather", {"city": "B"})
    body = chat_choice(
        fmt.Choice(0, text=text, finish_reason="stop"), None, tool_request(), "maybe"
    )
    message = body["message"]
    assert message["reasoning_content"] == f"maybe {inner}"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert message["content"] is None and body["finish_reason"] == "tool_calls"


def test_a_model_that_does_not_think_has_no_reasoning_content_key():
    body = chat_choice(fmt.Choice(0, text="<think>x</think>y", finish_reason="stop"), None, None)
    assert body["message"]["content"] == "<think>x</think>y"
    assert "reasoning_content" not in body["message"]


def test_streamed_tool_calls_send_no_empty_delta_while_a_call_is_held():
    stream = ChatText(tool_request(), None)
    block = call_block("get_time", {"zone": "A"})
    events = [stream.event(0, block[i : i + 4], None, None) for i in range(0, len(block), 4)]
    sent = [e for e in events if e is not None]
    assert len(sent) == 1 and sent[0]["delta"]["tool_calls"][0]["function"]["name"] == "get_time"
    last = stream.event(0, "", None, "stop")
    assert last is not None and last["finish_reason"] == "tool_calls"


# --- a grammar applies after the thinking --------------------------------------------------


def _accepts(tok: TextTokenizer, grammar: str, text: str, answer: str = "") -> bool:
    """Whether llguidance lets the model write `text`, then `answer` in bytes (as the
    grammar forces a literal "<tool_call>": llguidance takes added tokens as special), and
    then end."""
    lltok = llguidance.LLTokenizer(
        tok.tokenizer.to_str(), n_vocab=tok.vocab_size, eos_token=list(tok.eos_token_ids)
    )
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    in_bytes = tiny_qwen3.tokenizer(think_tokens=False, tool_tokens=False)
    ids = tok.encode(text, add_special=False) + in_bytes.encode(answer).ids
    return all(matcher.consume_token(t) for t in [*ids, tok.eos_token_ids[0]])


PERSON = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
GRAMMARS = {
    "json_schema": (build.json_schema(PERSON), '{"age": 7}', '{"age": "x"}'),
    "regex": (build.regex("Hi|Yo"), "Yo", "Hey"),
    "tools": (
        tool_grammar(tool_request("required", parallel=False)),
        call_block("get_time", {"zone": "A"}),
        "I will not call.",
    ),
}


@pytest.mark.parametrize("think_tokens", [True, False], ids=["tag-tokens", "tag-text"])
@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_a_grammar_starts_after_the_thinking_which_is_free(kind, think_tokens):
    tok = qwen(think_tokens)
    grammar, good, bad = GRAMMARS[kind]
    assert grammar is not None
    tags = think_tags(tok)
    assert tags is not None
    maybe = after_thinking(grammar, tags, "maybe")
    # Tags as text: the thinking is text (llguidance takes added tokens as special ones).
    markup = " <tool_call>" if think_tokens else ""
    free = f"<think>\nAnything {{goes}} here:{markup} no JSON.\n</think>\n\n"
    assert _accepts(tok, maybe, free, good)
    assert _accepts(tok, maybe, "", good)  # the model may answer without thinking
    assert not _accepts(tok, maybe, free, bad)
    assert not _accepts(tok, maybe, "<think>never closed ", good)
    assert not _accepts(tok, grammar, free, good)  # unwrapped, the grammar refuses it
    thinking = after_thinking(grammar, tags, "thinking")
    assert _accepts(tok, thinking, free.removeprefix("<think>"), good)
    assert not _accepts(tok, thinking, "", good)


def _parsed(body: dict) -> ApiRequest:
    """A chat body parsed, its grammar built as lifecycle.check builds it (in the pool)."""
    api = parse_request("chat", body, 4)
    assert api.grammar is not None
    g = api.grammar
    api.sampling["grammar"] = build.from_source(g.kind, g.source, g.param)
    return api


def test_a_chat_request_with_a_grammar_gets_it_after_the_thinking():
    body = {"model": "m", "messages": USER, "regex": "Hi|Yo"}
    api = _parsed(body)
    (prompt,) = prepare(api, qwen(), 1024)
    assert prompt.thinks == "maybe"
    assert prompt.sampling.grammar != api.sampling["grammar"]
    assert _accepts(qwen(), prompt.sampling.grammar, "<think>x</think>Yo")
    default, _, _ = load_tokenizer(default_model_path())
    (plain,) = prepare(api, default, 1024)
    assert plain.thinks is None and plain.sampling.grammar == api.sampling["grammar"]


@pytest.mark.parametrize(
    ("extra", "thinks"),
    [
        ({}, "maybe"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, None),
        ({"continue_final_message": True, "add_generation_prompt": False,
          "messages": [*USER, {"role": "assistant", "content": "<think>\nSo far"}]}, "thinking"),
        ({"continue_final_message": True, "add_generation_prompt": False,
          "messages": [*USER, {"role": "assistant", "content": "<think>x</think>Hel"}]}, None),
    ],
    ids=["thinking-on", "enable_thinking-false", "continued-thinking", "continued-answer"],
)  # fmt: skip
def test_the_chat_fields_decide_the_thinking_and_where_the_grammar_starts(extra, thinks):
    api = _parsed({"model": "m", "messages": USER, "regex": "Yo", **extra})
    (prompt,) = prepare(api, qwen(), 1024)
    assert prompt.thinks == thinks
    answer = "<think>x</think>Yo" if thinks == "maybe" else "x</think>Yo" if thinks else "Yo"
    assert _accepts(qwen(), prompt.sampling.grammar, answer)
    assert (prompt.sampling.grammar == api.sampling["grammar"]) == (thinks is None)


def test_a_grammar_too_long_after_the_thinking_is_a_400_naming_its_field():
    overhead = len(build.regex("a")) - 1
    pattern = "a" * (MAX_GRAMMAR_CHARS - overhead - 10)  # fits alone, not with the thinking
    api = _parsed({"model": "m", "messages": USER, "regex": pattern})
    with pytest.raises(ApiError) as e:
        prepare(api, qwen(), 1024)
    assert e.value.status == 400 and e.value.param == "regex"
