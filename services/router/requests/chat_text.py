"""A chat choice's output text -> the parts of its message: reasoning, content, tool calls.

    text = ChatText(tools, start)                           # one per choice
    body = text.choice(c, logprobs)                         # a finished choice (collect)
    event = text.event(index, text_delta, logprobs, finish_reason)   # streamed; None: no event

The model writes one text; the client sees it split. For a reasoning model (`start` not
None: structured/reasoning.py) the thinking part is `reasoning_content` and the rest the
answer. Tool-call blocks are read out of the answer (structured/tools/parse.py) for a
request with tools, unless tool_choice is "none" (then `tools` is None here); a choice
that called a tool and stopped by itself finishes with "tool_calls". A call cut by
max_tokens is dropped: its markup never reaches the content, and the choice finishes
with "length". A streamed piece that adds nothing (held back: a possible tag) sends no
event, unless it carries logprobs or the finish reason.
"""

from __future__ import annotations

from typing import Any

from services.router.formats.openai import shapes as fmt
from services.router.structured.reasoning import ReasoningStream, Start, split_reasoning
from services.router.structured.tools.parse import ToolCallStream, parse_tool_calls
from services.router.structured.tools.request import ToolRequest


def chat_choice(
    c: fmt.Choice, logprobs: Any, tools: ToolRequest | None, start: Start | None = None
) -> dict[str, Any]:
    """A finished chat choice as its body: the text split into its message's parts."""
    cut = c.finish_reason == "length"
    reasoning = None
    if start is not None:
        reasoning, c.text = split_reasoning(c.text, start, cut)
    if tools is None:
        body = fmt.chat_choice(c, logprobs)
    else:
        content, calls = parse_tool_calls(c.text, tools, cut)
        if calls and c.finish_reason == "stop":
            c.finish_reason = "tool_calls"
        c.text = content
        body = fmt.chat_choice(c, logprobs, [call.delta(i) for i, call in enumerate(calls)])
    if start is not None:
        body["message"]["reasoning_content"] = reasoning or None
    return body


class ChatText:
    """One streamed chat choice: each piece of text -> its chat delta event."""

    def __init__(self, tools: ToolRequest | None, start: Start | None = None) -> None:
        self.tools, self.start = tools, start
        self.calls = ToolCallStream(tools) if tools is not None else None
        self.thinking = ReasoningStream(start) if start is not None else None

    def choice(self, c: fmt.Choice, logprobs: Any) -> dict[str, Any]:
        """The choice, finished and not streamed, as its body (chat_choice)."""
        return chat_choice(c, logprobs, self.tools, self.start)

    def event(self, index: int, text: str, lp: Any, reason: str | None) -> dict[str, Any] | None:
        """The chat delta for `text`, the choice's next output (`reason` on its last), or
        None when there is nothing to send."""
        cut = reason == "length"
        delta: dict[str, Any] = {}
        if self.thinking is not None:
            reasoning, text = self.thinking.feed(text)
            if reason is not None:
                more, rest = self.thinking.finish(cut)
                reasoning, text = reasoning + more, text + rest
            if reasoning:
                delta["reasoning_content"] = reasoning
        if self.calls is not None:
            content, deltas = self.calls.feed(text)
            if reason is not None:
                rest, more_calls = self.calls.finish(cut)
                content, deltas = content + rest, deltas + more_calls
                if self.calls.called and reason == "stop":
                    reason = "tool_calls"
            if content:
                delta["content"] = content
            if deltas:
                delta["tool_calls"] = deltas
        elif text or (reason is None and self.thinking is None):
            delta["content"] = text
        if not delta and lp is None and reason is None:
            return None
        return fmt.chat_delta(index, delta, lp, reason)
