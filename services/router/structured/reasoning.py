"""Reasoning models: the thinking part of a chat answer, split out and left free.

    tags = think_tags(tokenizer)                   # ThinkTags | None: does the model think?
    start = output_start(tags, prompt_text)        # "thinking", "maybe" or None
    grammar = after_thinking(grammar, tags, start) # the request's grammar, after </think>
    stream = ReasoningStream(start)                # the output, as it streams:
    reasoning, content = stream.feed(text); ...; stream.finish(cut)

A model thinks in `<think>...</think>` (Qwen3, DeepSeek-R1 and their distillations) when
its chat template mentions `<think>` or its tokenizer has both tags as tokens. Where the
prompt leaves its output decides how the output is read:
  - the prompt ends with `<think>` (templates that open the thinking for the model): the
    output starts inside the thinking ("thinking");
  - it ends with `</think>` (Qwen3's template with `enable_thinking` false puts an empty
    thinking part in the prompt): there is no thinking to split (None);
  - otherwise the output may open with `<think>` ("maybe");
  - a continued final message (continue_final_message) is inside the thinking when it
    has an open `<think>`, else in the answer (None).
The text between the tags is the reasoning (`reasoning_content`), stripped of surrounding
whitespace; what follows `</think>` is the answer, its leading whitespace dropped, where
tool calls are read (tools/parse.py). An output that ends while thinking has reasoning
only.

A grammar (response_format, regex, ebnf, forced tools) applies to the answer only:
`after_thinking` puts a free thinking part in front of it, in llguidance's format. When
the tags are tokens of the tokenizer (llguidance treats added tokens as special), the
thinking is any tokens but `</think>` and end of sequence, then `</think>`; otherwise it is
text up to the first "</think>" (a lazy lexeme).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from libs.common.engine.load.tokenizer import TextTokenizer

OPEN, CLOSE = "<think>", "</think>"
Start = Literal["thinking", "maybe"]
_ANSWER = "answer"  # the name the wrapped grammar's start grammar gets
_WS = "WS: /[ \\t\\r\\n]+/"


@dataclass(frozen=True)
class ThinkTags:
    """How a reasoning model writes its tags: their token ids, when they are single tokens
    (None otherwise), and the end-of-sequence ids a thinking part may not contain."""

    open_id: int | None
    close_id: int | None
    eos_ids: tuple[int, ...] = ()


def think_tags(tokenizer: TextTokenizer) -> ThinkTags | None:
    """The model's thinking tags, or None for a model that does not think in them."""
    tok = tokenizer.tokenizer
    open_id, close_id = tok.token_to_id(OPEN), tok.token_to_id(CLOSE)
    template = tokenizer.chat_template or ""
    if (open_id is None or close_id is None) and OPEN not in template:
        return None
    if open_id is None or close_id is None:
        open_id = close_id = None
    return ThinkTags(open_id, close_id, tuple(tokenizer.eos_token_ids))


def output_start(tags: ThinkTags | None, prompt: str, continued: str | None = None) -> Start | None:
    """Where the model's output starts, after `prompt` (the rendered chat). `continued`:
    the text of the final (assistant) message the output continues (vLLM's
    continue_final_message), whose own tags say it: inside an open thinking part, or in
    the answer."""
    if tags is None:
        return None
    if continued is not None:
        return "thinking" if continued.rfind(OPEN) > continued.rfind(CLOSE) else None
    tail = prompt.rstrip()
    if tail.endswith(OPEN):
        return "thinking"
    if tail.endswith(CLOSE):
        return None
    return "maybe"


def after_thinking(grammar: str, tags: ThinkTags, start: Start) -> str:
    """`grammar` (llguidance's format: a JSON top-level grammar, or Lark) applied after
    the thinking part only; the thinking is free, then whitespace may follow `</think>`."""
    try:
        top = json.loads(grammar)
        grammars = [dict(g) for g in top["grammars"]]
    except (ValueError, TypeError, KeyError):
        top, grammars = {}, [{"lark_grammar": grammar}]
    names = {g.get("name") for g in grammars}
    answer = grammars[0].get("name") or _unused(_ANSWER, names)
    grammars[0]["name"] = answer
    if tags.close_id is not None:
        banned = ",".join(str(i) for i in (tags.close_id, *tags.eos_ids))
        thought, opening = f"<[^{banned}]>* <[{tags.close_id}]>", f"<[{tags.open_id}]>"
    else:
        thought, opening = "thought\nthought[lazy]: /(?s:.*)<\\/think>/", json.dumps(OPEN)
    if start == "thinking":
        rules = f"start: thinking WS? @{answer}"
    else:
        rules = f"start: {opening} thinking WS? @{answer} | @{answer}"
    lark = f"{rules}\nthinking: {thought}\n{_WS}\n"
    rest = {k: v for k, v in top.items() if k != "grammars"}
    return json.dumps({"grammars": [{"lark_grammar": lark}, *grammars], **rest})


def _unused(name: str, names: set) -> str:
    while name in names:
        name += "_"
    return name


class ReasoningStream:
    """Splits a chat output, as it streams, into reasoning and the answer's text.

    Text that may be the start of a tag is held until it is known; whitespace around the
    reasoning is held too, so the pieces add up to what one feed of the whole text gives.
    `start` None passes every text through as answer.
    """

    def __init__(self, start: Start | None) -> None:
        self.state: Literal["thinking", "maybe", "answer"] = start or "answer"
        self._held = ""  # a possible tag start, not sent yet
        self._space = ""  # reasoning whitespace not sent yet: it may turn out trailing
        self._reasoned = False  # any reasoning sent yet (leading whitespace is dropped)
        self._answered = False  # any answer text sent yet (leading whitespace is dropped)

    def feed(self, text: str) -> tuple[str, str]:
        """A new piece of output -> (reasoning to send now, answer text to send now)."""
        if self.state == "answer" and not self._held:
            return "", self._answer(text)
        buf, self._held = self._held + text, ""
        reasoning = ""
        if self.state == "maybe":
            head = buf.lstrip()
            if head.startswith(OPEN):
                buf, self.state = head[len(OPEN) :], "thinking"
            elif OPEN.startswith(head):  # too short to tell yet (or only whitespace)
                self._held = buf
                return "", ""
            else:
                self.state = "answer"
        if self.state == "thinking":
            at = buf.find(CLOSE)
            if at < 0:
                keep = _tag_start(buf, CLOSE)
                self._held = buf[len(buf) - keep :]
                return self._reason(buf[: len(buf) - keep]), ""
            reasoning, buf = self._reason(buf[:at]), buf[at + len(CLOSE) :]
            self.state = "answer"
        return reasoning, self._answer(buf)

    def finish(self, cut: bool = False) -> tuple[str, str]:
        """The end of output: held text goes where it was (a partial tag is dropped when
        the output was `cut`); trailing reasoning whitespace is dropped."""
        held, self._held = ("" if cut else self._held), ""
        if self.state == "thinking":
            return self._reason(held), ""
        return "", self._answer(held)

    def _reason(self, text: str) -> str:
        text = self._space + text
        if not self._reasoned:
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body) :]
        self._reasoned = self._reasoned or bool(body)
        return body

    def _answer(self, text: str) -> str:
        if not self._answered:
            text = text.lstrip()
            self._answered = bool(text)
        return text


def split_reasoning(text: str, start: Start | None, cut: bool = False) -> tuple[str, str]:
    """A finished output -> (its reasoning, its answer text)."""
    stream = ReasoningStream(start)
    reasoning, answer = stream.feed(text)
    more_reasoning, more_answer = stream.finish(cut)
    return reasoning + more_reasoning, answer + more_answer


def _tag_start(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
