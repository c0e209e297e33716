"""Tool calls out of a model's output: the Hermes-format blocks request.py asks for.

    content, calls = parse_tool_calls(text, req)     # a finished output
    stream = ToolCallStream(req)                     # a streamed one
    content_delta, call_deltas = stream.feed(text_delta); ...; stream.finish()

A block is a call when its JSON is an object with a "name" among the request's tools and
"arguments" an object; anything else stays in the content. With parallel_tool_calls false
only the first call counts (later blocks stay content), and with tool_choice "none"
nothing is parsed. Content is stripped of surrounding whitespace, streamed or not.

Content never carries call markup a call was cut in: a block that never closed (the
output ended inside it: max_tokens, a stop string) is dropped, and so, when the output
was cut (`cut`: its finish reason is "length"), is a trailing start of "<tool_call>".
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from services.router.structured.tools.request import CLOSE, OPEN, ToolRequest, parse_json

_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_ID_CHARS = string.ascii_letters + string.digits


@dataclass
class ToolCall:
    id: str  # "call_" + 24 random alphanumerics
    name: str
    arguments: str  # JSON text

    def delta(self, index: int) -> dict[str, Any]:
        """The call as one streaming `tool_calls` delta (also the non-streaming shape,
        without `index`)."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": index, "id": self.id, "type": "function", "function": function}


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def parse_tool_calls(text: str, req: ToolRequest, cut: bool = False) -> tuple[str, list[ToolCall]]:
    """A finished output -> (the content outside the call blocks, stripped; the calls)."""
    if req.choice == "none":
        return text, []
    calls: list[ToolCall] = []
    content: list[str] = []
    at = closed = 0
    for block in _BLOCK.finditer(text):
        closed = block.end()
        call = _call(block.group(1), req) if (req.parallel or not calls) else None
        if call is None:
            continue
        content.append(text[at : block.start()])
        at = block.end()
        calls.append(call)
    unclosed = text.find(OPEN, closed)
    rest = text[at:] if unclosed < 0 else text[at:unclosed]
    if cut and unclosed < 0:
        rest = rest[: len(rest) - _tag_start(rest)]
    content.append(rest)
    return "".join(content).strip(), calls


def _call(inner: str, req: ToolRequest) -> ToolCall | None:
    """The call a block's text makes, or None when it is not a call to one of the tools."""
    value = parse_json(inner.strip())
    if not isinstance(value, dict) or value.get("name") not in req.names:
        return None
    arguments = value.get("arguments")
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallStream:
    """Splits streamed output into content deltas and tool-call deltas as it arrives.

    Text that might be the start of "<tool_call>" is held back, so a partial tag is never
    sent as content; a block goes out as one tool-call delta, whole, when it closes.
    Whitespace next to blocks is held too, so the content streamed adds up to what
    parse_tool_calls returns for the same text.
    """

    def __init__(self, req: ToolRequest) -> None:
        self.req = req
        self._pending = ""  # held text: a possible tag start, or an open block's text
        self._inside = False
        self._space = ""  # whitespace not sent yet: it may turn out to be trailing
        self._sent = False  # any content sent yet (leading whitespace is dropped)
        self._calls = 0

    @property
    def called(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """A new piece of output -> (content to send now, tool-call deltas)."""
        if self.req.choice == "none":
            return text, []
        buf, content, deltas = self._pending + text, [], []
        while True:
            if not self._inside:
                i = buf.find(OPEN)
                if i < 0:
                    keep = _tag_start(buf)
                    content.append(self._content(buf[: len(buf) - keep]))
                    self._pending = buf[len(buf) - keep :]
                    break
                content.append(self._content(buf[:i]))
                buf, self._inside = buf[i + len(OPEN) :], True
                continue
            j = buf.find(CLOSE)
            if j < 0:
                self._pending = buf
                break
            call = _call(buf[:j], self.req) if (self.req.parallel or not self._calls) else None
            if call is None:
                content.append(self._content(OPEN + buf[: j + len(CLOSE)]))
            else:
                deltas.append(call.delta(self._calls))
                self._calls += 1
            buf, self._inside = buf[j + len(CLOSE) :], False
        return "".join(content), deltas

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        """The end of output: an unterminated block is dropped; a held partial tag is
        content, unless the output was `cut`; trailing whitespace is dropped."""
        if self.req.choice == "none":
            return "", []
        held = "" if self._inside or cut else self._pending
        self._pending, self._inside = "", False
        return self._content(held), []

    def _content(self, text: str) -> str:
        """Text outside blocks -> what to send now, holding trailing whitespace."""
        text = self._space + text
        if not self._sent:
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body) :]
        self._sent = self._sent or bool(body)
        return body


def _tag_start(text: str) -> int:
    """The length of the longest end of `text` that is a proper start of "<tool_call>"."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
