"""A program's state: the text so far (or the chat so far), what its calls stored, and
what each call cost.

A state is either text or chat, decided by its first use:

    text   s += "..." appends; s.gen / s.select continue the text
    chat   s.system(...), s.user(...) append messages; `await s.assistant(...)` runs one
           assistant turn made of strings, gen(...) and select(...) parts. The router
           renders the messages with the model's chat template (/v1/chat/render), so
           every call is a /v1/completions of one growing text and successive calls
           share their prefix in the workers' caches.

`fork(n)` copies the state into n branches that continue independently (run them with
asyncio.gather); `join(branches)` brings what they stored back as lists.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from llm_programs.calls import (
    Gen,
    Select,
    Usage,
    choice_logprob,
    completion_text,
    gen,
    prefix_body,
)
from llm_programs.errors import ProgramInputError
from llm_programs.gather import gather_all
from llm_programs.records import CallRecord, ChoiceScore, Piece
from llm_programs.router import Router

Sink = Callable[[Piece], None]


class State:
    def __init__(self, router: Router, program: str = "program", sink: Sink | None = None):
        self.router, self.program, self._sink = router, program, sink
        self.vars: dict[str, Any] = {}
        # A select's list[ChoiceScore]; after join(), one such list (or None) per branch.
        self.scores: dict[str, list[Any]] = {}
        self.calls: list[CallRecord] = []
        self.returned: Any = None  # what the program function returned
        self._text = ""
        self._messages: list[dict[str, str]] | None = None  # None: a text state
        self._turn: str | None = None  # the open assistant turn's text
        self._rendered: tuple[int, str] | None = None  # (messages, their generation prompt)
        self._busy: str | None = None
        self._parent: State | None = None
        self._shared: SharedPrefix | None = None  # a branch's prefix, sent once per fork
        self._names_at_fork: frozenset[str] = frozenset()
        self._joined = False

    # -- reading ------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """The text so far. In a chat: as last rendered by the router (after a run, the
        whole conversation)."""
        return self._text

    @property
    def messages(self) -> list[dict[str, str]]:
        return [dict(m) for m in self._messages or []]

    def __getitem__(self, name: str) -> Any:
        if name not in self.vars:
            raise KeyError(
                f"{self.program}: nothing stored under {name!r} (stored: {sorted(self.vars)})"
            )
        return self.vars[name]

    # -- text -----------------------------------------------------------------------------
    def __iadd__(self, text: str) -> State:
        if not isinstance(text, str):
            raise ProgramInputError(
                f"{self.program}: s += takes a string, got "
                f"{type(text).__name__} (await s.gen(...) to generate)"
            )
        if self._messages is not None:
            raise ProgramInputError(
                f"{self.program}: s += {text[:20]!r}: this state is a "
                "chat; use s.user(...) or s.assistant(...)"
            )
        self._text += text
        return self

    async def gen(self, name: str, max_tokens: int = 128, **kwargs: Any) -> str:
        """Generate and store under `name` (calls.gen's fields); returns the output."""
        return await self._call(gen(name, max_tokens, **kwargs))

    async def select(self, name: str, choices: Iterable[str]) -> str:
        """Store and append the likeliest of `choices`; returns it."""
        return await self._call(Select(name, tuple(choices)))

    # -- chat -----------------------------------------------------------------------------
    def system(self, content: str) -> None:
        self._message("system", content)

    def user(self, content: str) -> None:
        self._message("user", content)

    async def assistant(self, *parts: str | Gen | Select) -> str:
        """One assistant turn: its parts in order (strings appended as they are); the
        turn's text becomes the assistant message. Returns that text."""
        messages = self._message("assistant", None)
        self._turn = ""
        try:
            for part in parts:
                if isinstance(part, str):
                    self._turn += part
                elif isinstance(part, Gen | Select):
                    await self._call(part)
                else:
                    raise ProgramInputError(
                        f"{self.program}: assistant(): a part is a "
                        f"string, gen() or select(), not "
                        f"{type(part).__name__}"
                    )
            content = self._turn
        finally:
            self._turn = None
        messages.append({"role": "assistant", "content": content})
        return content

    async def finish(self) -> None:
        """In a chat, render the whole conversation into `text` (Program.arun does)."""
        if self._messages and self._parent is None:
            label = f"{self.program}: render"
            self._text = await self._timed(
                label, "render", {"messages": self.messages}, self._render(label, False)
            )

    # -- branches -------------------------------------------------------------------------
    def fork(self, n: int) -> list[State]:
        """n copies of this state, each continuing on its own (they share the prefix so
        far, which the router's caches compute once)."""
        if not isinstance(n, int) or n < 1:
            raise ProgramInputError(f"{self.program}: fork({n!r}): n must be an integer >= 1")
        shared = SharedPrefix(self, n) if n > 1 else None
        return [self._branch(i, shared) for i in range(n)]

    def join(self, branches: list[State]) -> list[str]:
        """Store, for each name the branches set since the fork, the list of their values
        (None where a branch did not set it), and their select scores likewise; adopt their
        call records. The text stays this state's. Returns the joined names."""
        for b in branches:
            if b._parent is not self:
                raise ProgramInputError(
                    f"{self.program}: join(): {b.program} is not a branch of this state"
                )
            if b._joined:
                raise ProgramInputError(f"{self.program}: join(): {b.program} was joined")
        names = list(
            dict.fromkeys(n for b in branches for n in b.vars if n not in b._names_at_fork)
        )
        for name in names:
            self._claim(f"{self.program}: join()", name)
        for name in names:
            self.vars[name] = [b.vars.get(name) for b in branches]
            if any(name in b.scores for b in branches):
                self.scores[name] = [b.scores.get(name) for b in branches]
        for b in branches:
            b._joined = True
            self.calls += b.calls
        return names

    # -- calls ----------------------------------------------------------------------------
    async def _call(self, call: Gen | Select) -> str:
        label = f"{self.program}: {call.label}"
        self._claim(label, call.name)
        if self._busy is not None:
            raise ProgramInputError(
                f"{label}: this state is running {self._busy}; fork it to run calls side by side"
            )
        self._busy = call.label
        try:
            if self._shared is not None:
                await self._shared.ready()
            prefix = await self._prefix(label)
            if isinstance(call, Gen):
                out = await self._gen(label, call, prefix)
            else:
                out = await self._select(label, call, prefix)
        finally:
            self._busy = None
        self.vars[call.name] = out
        self._append(out)
        return out

    async def _gen(self, label: str, call: Gen, prefix: str) -> str:
        body = call.body(self.router.model, prefix)
        if self._sink is None:
            work = self.router.complete(label, body)
        else:
            work = self._streamed(label, call.name, body, self._sink)
        return await self._timed(label, "gen", body, work)

    async def _streamed(
        self, label: str, name: str, body: dict[str, Any], sink: Sink
    ) -> dict[str, Any]:
        """The streamed completion, each piece to the sink, as a non-streamed answer."""
        body = {**body, "stream_options": {"include_usage": True}}
        pieces: list[str] = []
        answer: dict[str, Any] = {}
        async for event in self.router.stream(label, body):
            for choice in event.get("choices") or ():
                if choice.get("text"):
                    pieces.append(choice["text"])
                    sink(Piece(label, name, choice["text"]))
            answer["usage"] = event.get("usage") or answer.get("usage")
        answer["choices"] = [{"text": "".join(pieces)}]
        return answer

    async def _select(self, label: str, call: Select, prefix: str) -> str:
        # The first choice alone, then the others side by side: the first computes the
        # prefix (often new text, such as a question just added) and the others find it
        # in the cache instead of each computing it at the same time.
        work = [
            (f"{label} choice {c!r}", body)
            for c, body in zip(call.choices, call.bodies(self.router.model, prefix), strict=True)
        ]
        answers = [await self._score(*work[0])]
        answers += await gather_all(self._score(name, body) for name, body in work[1:])
        scores = []
        for choice, answer in zip(call.choices, answers, strict=True):
            logprob, tokens = choice_logprob(f"{label} choice {choice!r}", answer)
            scores.append(ChoiceScore(choice, logprob, tokens))
        self.scores[call.name] = scores
        best = max(range(len(scores)), key=lambda i: (scores[i].logprob, -i))
        return scores[best].choice

    async def _score(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._timed(name, "score", body, self.router.complete(name, body))

    async def _timed(self, label: str, kind: str, body: dict[str, Any], work: Awaitable) -> Any:
        """Await `work` and record the call; a completion's answer becomes its text."""
        t0 = time.perf_counter()
        out = await work
        usage = Usage.of(out) if isinstance(out, dict) else Usage()
        self.calls.append(CallRecord(label, kind, body, usage, time.perf_counter() - t0))
        if kind == "gen":
            return completion_text(label, out)[0]
        return out

    # -- internals ------------------------------------------------------------------------
    async def _prefix(self, label: str) -> str:
        if self._messages is None:
            return self._text
        if self._turn is None:
            raise ProgramInputError(
                f"{label}: in a chat, calls run inside an assistant "
                "turn: await s.assistant(gen(...))"
            )
        count = len(self._messages)
        if self._rendered is None or self._rendered[0] != count:
            body = {"messages": self.messages, "add_generation_prompt": True}
            rendered = await self._timed(
                f"{label} render", "render", body, self._render(f"{label} render", True)
            )
            self._rendered = (count, rendered)
        self._text = self._rendered[1] + self._turn
        return self._text

    async def _render(self, label: str, generation_prompt: bool) -> str:
        return await self.router.render(label, self.messages, generation_prompt)

    def _append(self, text: str) -> None:
        if self._turn is not None:
            self._turn += text
        self._text += text

    def _message(self, role: str, content: str | None) -> list[dict[str, str]]:
        """Append to the chat (None: only open it); returns the chat's messages."""
        where = f"{self.program}: {role}()"
        if role != "assistant" and not isinstance(content, str):
            raise ProgramInputError(f"{where}: content must be a string")
        if self._messages is None:
            if self._text:
                raise ProgramInputError(
                    f"{where}: this state is text (s += ...); a state is text or chat, not both"
                )
            self._messages = []
        if self._turn is not None or self._busy is not None:
            raise ProgramInputError(f"{where}: an assistant turn is still open")
        if content is not None:
            self._messages.append({"role": role, "content": content})
        return self._messages

    def _claim(self, label: str, name: str) -> None:
        if name in self.vars:
            raise ProgramInputError(
                f"{label}: the name {name!r} is already set in this "
                "state; each gen/select stores under its own name"
            )

    def _branch(self, i: int, shared: SharedPrefix | None) -> State:
        b = State(self.router, f"{self.program}[{i}]", self._sink)
        b._shared = shared
        b.vars, b.scores = dict(self.vars), dict(self.scores)
        b._text, b._turn, b._rendered = self._text, self._turn, self._rendered
        b._messages = None if self._messages is None else self.messages
        b._parent, b._names_at_fork = self, frozenset(self.vars)
        return b


class SharedPrefix:
    """What a fork's branches share, sent to the router once, before the first branch's
    first call: branches started side by side would otherwise each compute it (none finds
    it cached yet). One completion of one token, discarded, recorded on the parent as a
    `prefix` call. In a chat, the shared part is the conversation so far, rendered."""

    def __init__(self, parent: State, n: int):
        self.parent, self.label = parent, f"{parent.program}: fork({n}) prefix"
        self.text, self.messages = parent._text, parent._messages and parent.messages
        self._task: asyncio.Future | None = None

    async def ready(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._send())
        await asyncio.shield(self._task)  # one branch cancelled leaves it to the others

    async def _send(self) -> None:
        router, prompt = self.parent.router, self.text
        if self.messages:
            prompt = await router.render(self.label, self.messages, False)
        if prompt:
            body = prefix_body(router.model, prompt)
            await self.parent._timed(self.label, "prefix", body, router.complete(self.label, body))
