"""A chat choice's output text -> the parts of its message: reasoning, content, tool calls.

    text = ChatText(tools, start)                           # one per choice
    body = text.choice(c, logprobs)                         # a finished choice (collect)
    event = text.event(index, text_delta, logprobs, finish_reason)   # streamed; None: no event
    parts = text.feed(text_delta, finish_reason)            # the parts, for other formats
    parts = message_parts(text, finish_reason, tools, start)          # the same, whole

The model writes one text; the client sees it split. For a reasoning model (`start` not
None: structured/reasoning.py) the thinking part is `reasoning_content` and the rest the
answer. Tool-call blocks are read out of the answer (structured/tools/parse.py) for a
request with tools, unless tool_choice is "none" (then `tools` is None here); a choice
that called a tool and stopped by itself finishes with "tool_calls". A call cut by
max_tokens is dropped: its markup never reaches the content, and the choice finishes
with "length". A streamed piece that adds nothing (held back: a possible tag) sends no
event, unless it carries logprobs or the finish reason. /v1/responses and /v1/messages
read their output through the same parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.router.formats.openai import shapes as fmt
from services.router.structured.reasoning import ReasoningStream, Start, split_reasoning
from services.router.structured.tools.parse import ToolCallStream, parse_tool_calls
from services.router.structured.tools.request import ToolRequest


@dataclass
class Parts:
    """A message's parts (whole), or what a streamed piece adds to each. `calls` are in
    the streaming `tool_calls` shape (`index`, `id`, `type`, `function`); `reason` is the
    finish reason ("tool_calls" when the output called a tool and stopped by itself)."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    reason: str | None = None


def message_parts(
    text: str, reason: str | None, tools: ToolRequest | None, start: Start | None = None
) -> Parts:
    """A finished output's parts."""
    cut = reason == "length"
    parts = Parts(content=text, reason=reason)
    if start is not None:
        parts.reasoning, parts.content = split_reasoning(text, start, cut)
    if tools is not None:
        parts.content, calls = parse_tool_calls(parts.content, tools, cut)
        parts.calls = [call.delta(i) for i, call in enumerate(calls)]
        if calls and reason == "stop":
            parts.reason = "tool_calls"
    return parts


def chat_choice(
    c: fmt.Choice, logprobs: Any, tools: ToolRequest | None, start: Start | None = None
) -> dict[str, Any]:
    """A finished chat choice as its body: the text split into its message's parts."""
    parts = message_parts(c.text, c.finish_reason, tools, start)
    c.text, c.finish_reason = parts.content, parts.reason
    body = fmt.chat_choice(c, logprobs, parts.calls if tools is not None else None)
    if start is not None:
        body["message"]["reasoning_content"] = parts.reasoning or None
    return body


class ChatText:
    """One chat choice's text: each streamed piece -> its parts or its chat delta event."""

    def __init__(self, tools: ToolRequest | None, start: Start | None = None) -> None:
        self.tools, self.start = tools, start
        self.calls = ToolCallStream(tools) if tools is not None else None
        self.thinking = ReasoningStream(start) if start is not None else None

    def choice(self, c: fmt.Choice, logprobs: Any) -> dict[str, Any]:
        """The choice, finished and not streamed, as its body (chat_choice)."""
        return chat_choice(c, logprobs, self.tools, self.start)

    def whole(self, text: str, reason: str | None) -> Parts:
        """A finished output's parts (message_parts), for this choice's request."""
        return message_parts(text, reason, self.tools, self.start)

    def feed(self, text: str, reason: str | None) -> Parts:
        """What the choice's next piece of output adds to each part; `reason` on its last."""
        cut = reason == "length"
        parts = Parts(content=text, reason=reason)
        if self.thinking is not None:
            parts.reasoning, parts.content = self.thinking.feed(text)
            if reason is not None:
                more, rest = self.thinking.finish(cut)
                parts.reasoning, parts.content = parts.reasoning + more, parts.content + rest
        if self.calls is not None:
            parts.content, parts.calls = self.calls.feed(parts.content)
            if reason is not None:
                rest, more_calls = self.calls.finish(cut)
                parts.content, parts.calls = parts.content + rest, parts.calls + more_calls
                if self.calls.called and reason == "stop":
                    parts.reason = "tool_calls"
        return parts

    def event(self, index: int, text: str, lp: Any, reason: str | None) -> dict[str, Any] | None:
        """The chat delta for `text`, the choice's next output (`reason` on its last), or
        None when there is nothing to send."""
        parts = self.feed(text, reason)
        delta: dict[str, Any] = {}
        if parts.reasoning:
            delta["reasoning_content"] = parts.reasoning
        # A plain choice sends every piece as content (an empty one too, but the last).
        if parts.content or (reason is None and self.calls is None and self.thinking is None):
            delta["content"] = parts.content
        if parts.calls:
            delta["tool_calls"] = parts.calls
        if not delta and lp is None and reason is None:
            return None
        return fmt.chat_delta(index, delta, lp, parts.reason)
