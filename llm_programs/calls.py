"""The two model calls of the language, as values: `gen` and `select`, checked when
written, and the /v1/completions bodies they become.

    gen(name, ...)      one completion of the state's text; its output is appended and
                        stored under `name`
    select(name, choices)
                        one scoring request per choice: the choice appended to the state's
                        text, its tokens' prompt log-probabilities summed; the highest wins
                        (the first on a tie)

Scoring uses the router's prompt log-probabilities (docs/programs.md): `echo` with
`logprobs` 0, `max_tokens` 0 and `prompt_logprobs_from` = the character where the choice
starts, so only the choice's tokens are computed and the prefix comes from the cache.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llm_programs.errors import CallError, ProgramInputError

_SCHEMA_NAME = re.compile(r"[^a-zA-Z0-9_-]")


def _check_name(call: str, name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise ProgramInputError(f"{call}: the name must be a non-empty string, got {name!r}")


@dataclass(frozen=True)
class Gen:
    """A completion stored under `name`. `stop`: strings that end it (not included);
    `regex` or `json_schema` (one at most): the output is constrained to it by the router's
    grammar. Inside an assistant turn the model's end of turn also ends it."""

    name: str
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    temperature: float | None = None  # None: the router's default for the model
    regex: str | None = None
    json_schema: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _check_name("gen", self.name)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ProgramInputError(
                f"{self.label}: max_tokens must be an integer >= 1, got {self.max_tokens!r}"
            )
        if self.regex is not None and self.json_schema is not None:
            raise ProgramInputError(f"{self.label}: regex and json_schema are exclusive")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))

    @property
    def label(self) -> str:
        return f"gen({self.name!r})"

    def body(self, model: str, prompt: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": self.max_tokens}
        if self.stop:
            body["stop"] = list(self.stop)
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.regex is not None:
            body["regex"] = self.regex
        if self.json_schema is not None:
            name = _SCHEMA_NAME.sub("_", self.name)[:64]
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": name, "schema": self.json_schema},
            }
        return body


@dataclass(frozen=True)
class Select:
    """The likeliest of `choices` after the state's text, stored under `name`."""

    name: str
    # A list is taken too; __post_init__ stores a tuple.
    choices: Sequence[str] = field(default=())

    def __post_init__(self) -> None:
        _check_name("select", self.name)
        if isinstance(self.choices, str):
            raise ProgramInputError(
                f"{self.label}: choices must be a list of strings, not one string"
            )
        choices = tuple(self.choices)
        if not choices:
            raise ProgramInputError(f"{self.label}: no choices to select from")
        bad = [c for c in choices if not isinstance(c, str) or not c]
        if bad:
            raise ProgramInputError(
                f"{self.label}: each choice must be a non-empty string, got {bad[0]!r}"
            )
        object.__setattr__(self, "choices", choices)

    @property
    def label(self) -> str:
        return f"select({self.name!r})"

    def bodies(self, model: str, prefix: str) -> list[dict[str, Any]]:
        """One scoring request per choice, in order."""
        return [score_body(model, prefix, choice) for choice in self.choices]


def score_body(model: str, prefix: str, continuation: str) -> dict[str, Any]:
    """The request that scores `continuation` after `prefix` (the router's extension)."""
    return {
        "model": model,
        "prompt": prefix + continuation,
        "max_tokens": 0,
        "echo": True,
        "logprobs": 0,
        "prompt_logprobs_from": len(prefix),
    }


def prefix_body(model: str, prefix: str) -> dict[str, Any]:
    """A request that only puts `prefix` in the workers' caches (one token, greedy)."""
    return {"model": model, "prompt": prefix, "max_tokens": 1, "temperature": 0}


def gen(
    name: str,
    max_tokens: int = 128,
    *,
    stop: str | list[str] | tuple[str, ...] = (),
    temperature: float | None = None,
    regex: str | None = None,
    json_schema: dict[str, Any] | None = None,
) -> Gen:
    return Gen(
        name,
        max_tokens,
        tuple([stop] if isinstance(stop, str) else stop),
        temperature,
        regex,
        json_schema,
    )


def select(name: str, choices: list[str] | tuple[str, ...]) -> Select:
    return Select(name, choices)


@dataclass(frozen=True)
class Usage:
    """What the router reported for one request (usage and its prefix-cache hit)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def of(cls, body: dict[str, Any]) -> Usage:
        usage = body.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return cls(
            usage.get("prompt_tokens", 0),
            details.get("cached_tokens") or 0,
            usage.get("completion_tokens", 0),
        )


def completion_text(call: str, body: dict[str, Any]) -> tuple[str, str | None]:
    """(text, finish_reason) of a non-streamed completion's only choice."""
    try:
        choice = body["choices"][0]
        return choice["text"], choice.get("finish_reason")
    except (KeyError, IndexError, TypeError):
        raise CallError(call, "the router's answer has no choices[0].text") from None


def choice_logprob(call: str, body: dict[str, Any]) -> tuple[float, int]:
    """(sum of the scored tokens' log-probabilities, how many) from a scoring answer; a
    null entry (the prompt's first token) counts as 0."""
    try:
        logprobs = body["choices"][0]["logprobs"]
        values = logprobs["token_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise CallError(
            call,
            "the router returned no prompt logprobs "
            "(does it support echo with prompt_logprobs_from?)",
        ) from None
    return sum(v for v in values if v is not None), len(values)
