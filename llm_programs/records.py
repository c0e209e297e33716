"""What a run records: each request it sent (CallRecord), each select's scores
(ChoiceScore), each streamed piece of a gen (Piece)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llm_programs.calls import Usage


@dataclass(frozen=True)
class CallRecord:
    """One request a state sent: its label, kind (gen, score, render), the body sent (to
    replay it by hand), the usage the router reported and the wall time."""

    call: str
    kind: str
    body: dict[str, Any]
    usage: Usage = field(default_factory=Usage)
    seconds: float = 0.0


@dataclass(frozen=True)
class ChoiceScore:
    """A select's choice: the sum of its tokens' log-probabilities, and how many."""

    choice: str
    logprob: float
    tokens: int


@dataclass(frozen=True)
class Piece:
    """A streamed piece of a gen's output (Program.stream)."""

    call: str
    name: str
    text: str
