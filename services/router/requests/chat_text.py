"""A chat choice's output text -> the parts of its message: content and tool calls.

    message = chat_choice(c, logprobs, tools)               # a finished choice (collect)
    text = ChatText(tools)                                  # a streamed one, per choice
    event = text.event(index, text_delta, logprobs, finish_reason)

The model writes one text; the client sees it split. Tool-call blocks are read out of it
(structured/tools/parse.py) for a request with tools, unless tool_choice is "none" (then
`tools` is None here); a choice that called a tool and stopped by itself finishes with
"tool_calls". A call cut by max_tokens is dropped: its markup never reaches the content,
and the choice finishes with "length".
"""

from __future__ import annotations

from typing import Any

from services.router.formats.openai import shapes as fmt
from services.router.structured.tools.parse import ToolCallStream, parse_tool_calls
from services.router.structured.tools.request import ToolRequest


def chat_choice(c: fmt.Choice, logprobs: Any, tools: ToolRequest | None) -> dict[str, Any]:
    """A finished chat choice as its body: the text split into content and tool calls."""
    if tools is None:
        return fmt.chat_choice(c, logprobs)
    content, calls = parse_tool_calls(c.text, tools, cut=c.finish_reason == "length")
    if calls and c.finish_reason == "stop":
        c.finish_reason = "tool_calls"
    c.text = content
    return fmt.chat_choice(c, logprobs, [call.delta(i) for i, call in enumerate(calls)])


class ChatText:
    """One streamed chat choice: each piece of text -> its chat delta event."""

    def __init__(self, tools: ToolRequest | None) -> None:
        self.calls = ToolCallStream(tools) if tools is not None else None

    def event(self, index: int, text: str, lp: Any, reason: str | None) -> dict[str, Any]:
        """The chat delta for `text`, the choice's next output; `reason` on its last."""
        if self.calls is None:
            delta = {"content": text} if text or reason is None else {}
            return fmt.chat_delta(index, delta, lp, reason)
        return _tool_delta(index, text, self.calls, lp, reason)


def _tool_delta(
    index: int, text: str, calls: ToolCallStream, lp: Any, reason: str | None
) -> dict[str, Any]:
    """A chat delta with tools: the text split into content and whole tool calls; the
    finish reason is "tool_calls" when the choice called one and stopped by itself."""
    content, deltas = calls.feed(text)
    if reason is not None:
        rest, more = calls.finish(cut=reason == "length")
        content, deltas = content + rest, deltas + more
        if calls.called and reason == "stop":
            reason = "tool_calls"
    delta: dict[str, Any] = {"content": content} if content else {}
    if deltas:
        delta["tool_calls"] = deltas
    return fmt.chat_delta(index, delta, lp, reason)
