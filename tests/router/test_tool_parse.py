"""Tool calls read back out of the output (services/router/structured/tools/parse.py), whole
and streamed (the request side: test_tool_request.py)."""

from __future__ import annotations

import re

import pytest

from services.router.structured.tools.parse import ToolCallStream, parse_tool_calls
from services.router.structured.tools.request import ToolRequest
from tests.router.tool_cases import call_block, tool_request

# --- parse_tool_calls -------------------------------------------------------------------


def test_calls_are_parsed_out_and_the_content_kept():
    text = "Let me look.\n" + call_block("get_weather", {"city": "Paris"}) + "\n"
    text += call_block("get_time", {"zone": "CET"})
    content, calls = parse_tool_calls(text, tool_request())
    assert content == "Let me look."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", '{"zone": "CET"}'),
    ]
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id) for c in calls)
    assert calls[0].id != calls[1].id


def test_arguments_are_reserialized_compactly_without_ascii_escapes():
    text = '<tool_call>{"name":"get_weather","arguments":{ "city" :  "Zürich" }}</tool_call>'
    _, calls = parse_tool_calls(text, tool_request())
    assert calls[0].arguments == '{"city": "Zürich"}'


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        call_block("get_news", {"q": "x"}),
        call_block("get_time", "UTC"),
        '<tool_call>\n{"name": "get_time"}\n</tool_call>',
    ],
)
def test_a_block_that_is_not_a_call_stays_in_the_content(block):
    content, calls = parse_tool_calls("Hi. " + block, tool_request())
    assert calls == [] and content == "Hi. " + block


def test_without_parallel_calls_only_the_first_block_is_a_call():
    one, two = call_block("get_time", {"zone": "A"}), call_block("get_time", {"zone": "B"})
    content, calls = parse_tool_calls(one + "\n" + two, tool_request(parallel=False))
    assert len(calls) == 1 and calls[0].arguments == '{"zone": "A"}' and content == two


def test_tool_choice_none_parses_nothing():
    text = call_block("get_time", {"zone": "A"})
    assert parse_tool_calls(text, tool_request("none")) == (text, [])


# --- ToolCallStream ---------------------------------------------------------------------


def _stream(
    pieces: list[str], req: ToolRequest | None = None, cut: bool = False
) -> tuple[list[str], list[dict]]:
    stream = ToolCallStream(req or tool_request())
    sent, deltas = [], []
    for piece in pieces:
        content, new = stream.feed(piece)
        sent.append(content)
        deltas += new
    content, new = stream.finish(cut)
    return [*sent, content], deltas


STREAMED = [
    "Let me look.\n"
    + call_block("get_weather", {"city": "Paris"})
    + "\n"
    + call_block("get_time", {"zone": "CET"}),
    "  <tool_call> x </tool_call> then " + call_block("get_time", {"zone": "Z"}) + " done <tool_c",
    "a < b <tool <tool_call" + "\n" + '{"name": "get_time", "arguments": {}}',
    "no calls at all, just an answer with a <tag>.",
]


@pytest.mark.parametrize("cut", [False, True])
@pytest.mark.parametrize("text", STREAMED)
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_output_adds_up_to_the_parsed_output(text, size, cut):
    sent, deltas = _stream([text[i : i + size] for i in range(0, len(text), size)], cut=cut)
    content, calls = parse_tool_calls(text, tool_request(), cut)
    assert "".join(sent) == content
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
        (c.name, c.arguments) for c in calls
    ]


def test_a_partial_tag_is_never_sent_as_content():
    stream = ToolCallStream(tool_request())
    assert stream.feed("Hi <tool") == ("Hi", [])
    assert stream.feed("_ca") == ("", [])
    content, deltas = stream.feed(
        'll>\n{"name": "get_time", "arguments": {"zone": "A"}}\n</tool_call>'
    )
    assert content == "" and len(deltas) == 1 and stream.called


def test_a_held_back_non_tag_goes_out_once_it_cannot_be_a_tag():
    stream = ToolCallStream(tool_request())
    assert stream.feed("x <to") == ("x", [])
    assert stream.feed("p") == (" <top", [])


def test_tool_call_deltas_have_openais_streaming_shape_and_count_up():
    text = call_block("get_time", {"zone": "A"}) + "\n" + call_block("get_weather", {"city": "B"})
    _, deltas = _stream([text])
    assert [d["index"] for d in deltas] == [0, 1]
    assert set(deltas[0]) == {"index", "id", "type", "function"}
    assert deltas[0]["type"] == "function" and deltas[0]["id"].startswith("call_")
    assert deltas[1]["function"] == {"name": "get_weather", "arguments": '{"city": "B"}'}


def test_an_unterminated_block_is_dropped_at_the_finish_never_sent_as_content():
    stream = ToolCallStream(tool_request())
    assert stream.feed('Sure. <tool_call>\n{"name": "get_time"') == ("Sure.", [])
    assert stream.finish(cut=True) == ("", [])
    assert not stream.called


CUT = [
    call_block("get_time", {"zone": "A"}) + '\n<tool_call>\n{"name": "get_weather", "argu',
    'I will check. <tool_call>\n{"name": "get_ti',
    "Checking <tool_",
    "<tool_call>",
    "<tool_call> x </tool_call> <tool_call> y <tool_call>",
]


@pytest.mark.parametrize("text", CUT)
def test_a_call_cut_short_leaves_no_markup_in_the_content(text):
    content, calls = parse_tool_calls(text, tool_request(), cut=True)
    sent, _ = _stream(list(text), cut=True)
    assert "".join(sent) == content
    assert "<tool_" not in content.replace("<tool_call> x </tool_call>", "")
    assert '"name"' not in content
    assert len(calls) == text.count("</tool_call>") - text.count(" x </tool_call>")


def test_a_trailing_partial_tag_stays_content_when_the_output_was_not_cut():
    assert parse_tool_calls("a <tool_c", tool_request()) == ("a <tool_c", [])
    assert parse_tool_calls("a <tool_c", tool_request(), cut=True) == ("a", [])


def test_a_stream_for_tool_choice_none_passes_text_through():
    stream = ToolCallStream(tool_request("none"))
    text = " " + call_block("get_time", {"zone": "A"})
    assert stream.feed(text) == (text, []) and stream.finish() == ("", [])
    assert not stream.called
