"""Branch and judge: three drafts of an answer written side by side in forked branches
(each with its own instruction, all sharing the conversation so far), then a judge turn
that picks the best draft with `select`."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from llm_programs import State, function, gen, select
from llm_programs.examples import cli

SYSTEM = (
    "You are a careful science teacher. You explain to curious adults, without jargon, "
    "and you prefer one precise statement to three vague ones. When a question has a "
    "common misconception, you name it and correct it."
)
STYLES = ("in one sentence", "with an everyday example", "step by step, in three steps")
QUESTIONS = (
    "Why is the sky blue?",
    "Why do we have seasons?",
    "How does a refrigerator keep food cold?",
    "Why does ice float on water?",
    "What makes a rainbow?",
    "Why do onions make us cry?",
)


@function
async def branch_and_judge(s: State, question: str) -> None:
    """Drafts in three styles, then the judge's pick stored under `best`."""
    s.system(SYSTEM)
    s.user(question)
    branches = s.fork(len(STYLES))
    for b, style in zip(branches, STYLES, strict=True):
        b.user(f"Answer {style}.")
    await asyncio.gather(*(b.assistant(gen("draft", 48, temperature=0)) for b in branches))
    s.join(branches)
    drafts = "\n".join(f"{i + 1}. {d}" for i, d in enumerate(s["draft"]))
    s.user(
        f"Here are three answers:\n{drafts}\nWhich one is the most accurate? "
        "Reply with its number only."
    )
    await s.assistant(select("best", [str(i + 1) for i in range(len(STYLES))]))


program = branch_and_judge


def inputs(n: int) -> list[dict[str, Any]]:
    return [{"question": QUESTIONS[i % len(QUESTIONS)]} for i in range(n)]


def show(state: State) -> dict[str, Any]:
    scores = {c.choice: round(c.logprob, 3) for c in state.scores["best"]}
    return {
        "question": state.messages[1]["content"],
        "drafts": state["draft"],
        "best": state["best"],
        "scores": scores,
    }


def main(argv: list[str] | None = None) -> int:
    return cli.main(program, inputs, show, argv)


if __name__ == "__main__":
    sys.exit(main())
