"""A multi-turn chat: a system prompt, then one assistant turn per question; each turn's
prompt is the whole conversation so far, which the workers hold from the turn before."""

from __future__ import annotations

import sys
from typing import Any

from llm_programs import State, function, gen
from llm_programs.examples import cli

SYSTEM = (
    "You are a patient travel guide. You answer in two or three short sentences, with one "
    "concrete suggestion each time: a place, a dish, a walk or a museum. You never invent "
    "opening hours or prices; when asked for them, you say to check the official site. You "
    "keep to the city the traveller asked about, and you remember what they said before."
)
CITIES = ("Paris", "Rome", "Kyoto", "Lisbon", "Cairo", "Lima", "Oslo", "Quebec")
QUESTIONS = (
    "I am spending a weekend in {city}. Where should I start on the first morning?",
    "What should I eat for lunch near there?",
    "And one thing to do in the evening?",
)


@function
async def multi_turn_chat(s: State, city: str, turns: int = len(QUESTIONS)) -> None:
    """A conversation about `city`, `turns` questions long."""
    s.system(SYSTEM)
    for i, question in enumerate(QUESTIONS[:turns]):
        s.user(question.format(city=city))
        await s.assistant(gen(f"answer_{i}", 48, temperature=0))


program = multi_turn_chat


def inputs(n: int) -> list[dict[str, Any]]:
    return [{"city": CITIES[i % len(CITIES)]} for i in range(n)]


def show(state: State) -> dict[str, Any]:
    return {"messages": state.messages}


def main(argv: list[str] | None = None) -> int:
    return cli.main(program, inputs, show, argv)


if __name__ == "__main__":
    sys.exit(main())
