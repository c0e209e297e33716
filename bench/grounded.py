"""An input-grounded workload: edits, extractions and summaries whose answers quote their
prompt, built from real text (this repository's own docs/*.md and Python files).

Speculative decoding by n-gram lookup pays where an answer repeats its input; this is that
case, made reproducible. Four kinds of task, each a chat message around one piece of text:
- `rewrite`: a paragraph of docs/*.md, "replace the word A with B, change nothing else";
- `fix`: a function of bench/*.py or libs/common/**/*.py with one operator flipped
  (`<=` for `<`, `+ 1` for `- 1`, ...), "return the corrected function in full";
- `extract`: a paragraph, "copy every sentence that mentions W, word for word";
- `summary`: a paragraph, "summarize it in two sentences, reusing its wording".
Paragraphs are unwrapped to one line (the docs wrap at ~90 columns); code keeps its lines.
The texts come from a snapshot of the tree, bench/grounded_corpus.json (`corpus()`), so
`tasks(n, seed)` gives the same tasks at every commit: a before/after comparison runs the
same workload on both sides. `python -m bench.grounded --snapshot` writes it anew from the
tree as it is (a new workload: say so beside any figure measured on it); `tasks(...,
root=path)` draws from a tree instead. Each task names its source.
`as_json` asks for the answer as a JSON object of one string (`schema` is its schema), for
runs under a grammar.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CORPUS = Path(__file__).with_name("grounded_corpus.json")
KINDS = ("rewrite", "fix", "extract", "summary")

# One operator flipped per `fix` task: (what the correct code has, what the bug puts there).
BUGS = ((" <= ", " < "), (" >= ", " > "), (" + 1", " - 1"), (" == ", " != "),
        ("max(", "min("), (" and ", " or "), (" is None", " is not None"))  # fmt: skip

_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(])")
_WORD = re.compile(r"\b[a-z]{5,12}\b")

# The JSON answer `as_json` asks for: one string, the whole answer.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}


def response_format() -> dict[str, Any]:
    """The OpenAI API's `response_format` that enforces SCHEMA."""
    return {"type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}  # fmt: skip


@dataclass(frozen=True)
class Task:
    """One request: `kind`, where its text comes from, and the user message."""

    kind: str
    source: str
    prompt: str

    def messages(self, as_json: bool = False) -> list[dict[str, str]]:
        text = self.prompt
        if as_json:
            text += '\n\nReply in JSON: an object whose "answer" field holds your whole answer.'
        return [{"role": "user", "content": text}]


def paragraphs(root: Path = REPO, low: int = 300, high: int = 900) -> list[tuple[str, str]]:
    """(source, text) of every prose paragraph of docs/*.md of `low`-`high` characters,
    unwrapped to one line: no headings, tables, lists, code or indented blocks."""
    found = []
    for path in sorted((root / "docs").glob("*.md")):
        in_code = False
        for i, block in enumerate(path.read_text().split("\n\n")):
            lines = block.strip().splitlines()
            fences = sum(line.lstrip().startswith("```") for line in lines)
            was_code, in_code = in_code, in_code ^ (fences % 2 == 1)
            if not lines or was_code or fences or lines[0][:1] in "#|-*>0123456789 ":
                continue
            text = " ".join(line.strip() for line in lines)
            if low <= len(text) <= high:
                found.append((f"{path.relative_to(root)}#{i}", text))
    return found


def functions(root: Path = REPO, low: int = 6, high: int = 30) -> list[tuple[str, str]]:
    """(source, code) of every top-level function of bench/*.py and libs/common/**/*.py of
    `low`-`high` lines that some entry of BUGS can break."""
    found = []
    files = sorted([*(root / "bench").glob("*.py"), *(root / "libs" / "common").rglob("*.py")])
    for path in files:
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                code = "\n".join(lines[start - 1 : node.end_lineno])
                fits = low <= node.end_lineno - start + 1 <= high
                if fits and any(good in code for good, _ in BUGS):
                    found.append((f"{path.relative_to(root)}:{node.name}", code))
    return found


def _rewrite(rng: random.Random, text: str) -> str | None:
    words = sorted(set(_WORD.findall(text)))
    if not words:
        return None
    old = rng.choice(words)
    new = rng.choice([w for w in ("banana", "lantern", "harbor", "velvet", "orbit") if w != old])
    return (f'Rewrite the following paragraph, replacing the word "{old}" with "{new}" '
            f"everywhere. Change nothing else.\n\n{text}")  # fmt: skip


def _fix(rng: random.Random, code: str) -> str:
    good, bad = rng.choice([b for b in BUGS if b[0] in code])
    at = [m.start() for m in re.finditer(re.escape(good), code)]
    cut = rng.choice(at)
    broken = code[:cut] + bad + code[cut + len(good) :]
    return ("This Python function has a bug: one operator is wrong. Return the corrected "
            f"function in full.\n\n```python\n{broken}\n```")  # fmt: skip


def _extract(rng: random.Random, text: str) -> str | None:
    sentences = _SENTENCE.split(text)
    words = sorted({w for s in sentences for w in _WORD.findall(s)})
    if len(sentences) < 2 or not words:
        return None
    word = rng.choice(words)
    return (f'Copy, word for word, every sentence of the text below that mentions "{word}".'
            f"\n\n{text}")  # fmt: skip


def _summary(rng: random.Random, text: str) -> str:
    return ("Summarize the following paragraph in two sentences, reusing its own wording."
            f"\n\n{text}")  # fmt: skip


Texts = tuple[list[tuple[str, str]], list[tuple[str, str]]]  # paragraphs, functions


def corpus(path: Path = CORPUS) -> Texts:
    """The snapshot's (source, text) paragraphs and (source, code) functions."""
    data = json.loads(path.read_text())
    return ([(s, t) for s, t in data["paragraphs"]], [(s, c) for s, c in data["functions"]])


def snapshot(root: Path = REPO, path: Path = CORPUS) -> Texts:
    """Write the paragraphs and functions of the tree at `root` to `path`."""
    prose, code = paragraphs(root), functions(root)
    path.write_text(json.dumps({"paragraphs": prose, "functions": code}, indent=0) + "\n")
    return prose, code


def tasks(n: int, seed: int = 0, kinds: tuple[str, ...] = KINDS, root: Path | None = None
          ) -> list[Task]:  # fmt: skip
    """`n` tasks, the kinds in turn, each on a text drawn (seeded) from the snapshot
    (`corpus()`), or from the tree at `root`."""
    if n < 1:
        raise ValueError("tasks: n must be >= 1")
    unknown = set(kinds) - set(KINDS)
    if not kinds or unknown:
        raise ValueError(f"tasks: kinds must be among {', '.join(KINDS)}, got {kinds!r}")
    rng = random.Random(seed)
    prose, code = corpus() if root is None else (paragraphs(root), functions(root))
    if not prose or not code:
        raise ValueError(f"tasks: no paragraphs or functions under {root or CORPUS}")
    out: list[Task] = []
    while len(out) < n:
        kind = kinds[len(out) % len(kinds)]
        source, text = rng.choice(code if kind == "fix" else prose)
        make = {"rewrite": _rewrite, "fix": _fix, "extract": _extract, "summary": _summary}
        prompt = make[kind](rng, text)
        if prompt is not None:
            out.append(Task(kind, source, prompt))
    return out


def main(argv: list[str] | None = None) -> int:
    doc = (__doc__ or "").split("\n")[0]
    ap = argparse.ArgumentParser(prog="python -m bench.grounded", description=doc)
    what = f"write {CORPUS.name} anew from this tree (changes the workload)"
    ap.add_argument("--snapshot", action="store_true", help=what)
    args = ap.parse_args(argv)
    if not args.snapshot:
        prose, code = corpus()
        print(f"{CORPUS}: {len(prose)} paragraphs, {len(code)} functions")
        return 0
    prose, code = snapshot()
    print(f"wrote {CORPUS}: {len(prose)} paragraphs, {len(code)} functions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
