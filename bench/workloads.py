"""What bench.serve sends: random prompts, multi-turn conversations, Mooncake trace replay,
input-grounded tasks (bench/grounded.py).

A workload hands the driver `Turn`s (one request each) and is told when each finishes, so
that a conversation's next round can carry the previous answer. Prompts are made of words
that common BPE tokenizers keep as one token each (" the", " time", ...), so a prompt of
`n` words is close to `n` tokens on any model; the exact counts come back in `usage`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bench import grounded

# Frequent English words; each is one token (with its leading space) in the Llama, SmolLM2,
# Qwen2 and GPT-2 vocabularies, so word count ~ token count and equal words = equal tokens.
WORDS = (
    "the of and to in is was for on that with as by at from his her are this be it not "
    "or an have had one all were which they their has been would more there we can who "
    "will new time first two other some its may about when out after also into only what "
    "over most them these many over such years city time world school state people year "
    "water house music story game river light power party south north west east table "
    "paper money order point field group place line night sound space voice woman child "
    "market energy number system letter garden window doctor summer winter bridge forest "
    "island mountain valley ocean station village author teacher student question answer"
).split()
WORDS = tuple(dict.fromkeys(WORDS))  # unique, in order


@dataclass
class Turn:
    """One request: chat `messages`, at most `max_tokens` out, sent at `at` seconds when set.

    `at=None` means "as soon as the driver's arrival process allows" (Poisson, rate cap).
    `extra`: more body fields of this request (e.g. a `response_format`).
    """

    request_id: int
    client: int
    round: int
    messages: list[dict[str, str]]
    max_tokens: int
    at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Workload(Protocol):
    """The contract the driver relies on.

    `initial()` is called once; `done(turn, ok, text)` after every request, and returns the
    turns it releases (possibly none). `total` bounds how many turns can ever be released.
    """

    total: int

    def initial(self) -> list[Turn]: ...

    def done(self, turn: Turn, ok: bool, text: str) -> list[Turn]: ...


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(0, n)))


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    low = max(1, int(mean * (1 - range_ratio)))
    return rng.randint(low, max(low, int(mean * (1 + range_ratio))))


@dataclass
class MultiTurn:
    """`clients` conversations of `rounds` rounds each (SGLang's HiCache multi-turn shape).

    Round 0 asks a question of `request_len` words; each later round appends the previous
    answer and a new question of `question_len` words, so round r resends the whole history
    and a prefix cache can serve all but the newest question. With `barrier`, round r+1
    starts for nobody until every client has finished round r. A client whose request
    fails ends its conversation (its later rounds are not sent). `rounds=1` with no
    history is the random workload.
    """

    clients: int
    rounds: int
    request_len: int
    question_len: int
    output_len: int
    range_ratio: float = 0.0
    barrier: bool = False
    seed: int = 0
    history: dict[int, list[dict[str, str]]] = field(default_factory=dict)
    _next_id: int = 0
    _waiting: list[Turn] = field(default_factory=list)
    _open_in_round: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        flags = {"clients": "--num-clients", "rounds": "--num-rounds",
                 "request_len": "--input-len", "question_len": "--question-len",
                 "output_len": "--output-len"}  # fmt: skip
        for name, flag in flags.items():
            if getattr(self, name) < 1:
                raise ValueError(f"{flag}: must be >= 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError("--range-ratio: must be in [0, 1)")
        self.rng = random.Random(self.seed)

    @property
    def total(self) -> int:
        return self.clients * self.rounds

    def initial(self) -> list[Turn]:
        self._open_in_round[0] = self.clients
        return [self._turn(c, 0) for c in range(self.clients)]

    def done(self, turn: Turn, ok: bool, text: str) -> list[Turn]:
        released: list[Turn] = []
        if ok and turn.round + 1 < self.rounds:
            self.history[turn.client].append({"role": "assistant", "content": text})
            nxt = self._turn(turn.client, turn.round + 1)
            (self._waiting if self.barrier else released).append(nxt)
        if self.barrier:
            self._open_in_round[turn.round] -= 1
            if self._open_in_round[turn.round] == 0:
                released, self._waiting = self._waiting, []
                self._open_in_round[turn.round + 1] = len(released)
        return released

    def _turn(self, client: int, rnd: int) -> Turn:
        length = self.request_len if rnd == 0 else self.question_len
        # A per-client tag first, so two clients never share more than the chat template.
        tag = f"Conversation {client}." if rnd == 0 else f"Question {rnd + 1}:"
        question = f"{tag} {words(self.rng, _length(self.rng, length, self.range_ratio))}"
        history = self.history.setdefault(client, [])
        history.append({"role": "user", "content": question})
        self._next_id += 1
        out = _length(self.rng, self.output_len, self.range_ratio)
        return Turn(self._next_id - 1, client, rnd, list(history), out)


@dataclass
class TraceReplay:
    """Replay a Mooncake trace (JSON lines: timestamp ms, input_length, output_length,
    hash_ids of 512-token blocks) with prompts whose equal hash_ids are equal word blocks.

    Scaling: a trace block of `trace_block` tokens becomes `block_len` words, and every
    length is scaled by the same `block_len / trace_block`; outputs are scaled by
    `output_scale` (at least 1 token); timestamps are multiplied by `time_scale` (0.1 plays
    the trace ten times faster). `max_requests` and `max_input` bound the replay.
    """

    path: Path
    block_len: int = 16
    trace_block: int = 512
    output_scale: float = 1.0
    time_scale: float = 1.0
    max_requests: int = 100
    max_input: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_len < 1:
            raise ValueError("--trace-block-len: must be >= 1")
        if self.output_scale <= 0:
            raise ValueError("--trace-output-scale: must be > 0")
        if self.time_scale < 0:
            raise ValueError("--trace-time-scale: must be >= 0")
        if self.max_requests < 1:
            raise ValueError("--num-prompts: must be >= 1")
        self.blocks: dict[int, str] = {}
        self.turns = self._load()

    @property
    def total(self) -> int:
        return len(self.turns)

    def initial(self) -> list[Turn]:
        return list(self.turns)

    def done(self, turn: Turn, ok: bool, text: str) -> list[Turn]:
        return []

    def _block(self, hash_id: int) -> str:
        # Seeded by the id alone: the same id is the same text in every prompt and every run.
        if hash_id not in self.blocks:
            self.blocks[hash_id] = words(random.Random(f"{self.seed}:{hash_id}"), self.block_len)
        return self.blocks[hash_id]

    def prompt(self, input_length: int, hash_ids: list[int]) -> str:
        scale = self.block_len / self.trace_block
        n = max(1, round(input_length * scale))
        if self.max_input:
            n = min(n, self.max_input)
        parts, left = [], n
        for h in hash_ids:
            if left <= 0:
                break
            block = self._block(h).split(" ")[: min(left, self.block_len)]
            parts.append(" ".join(block))
            left -= len(block)
        if left > 0:  # the trace's blocks are shorter than its length: pad with fresh words
            parts.append(words(random.Random(f"{self.seed}:pad:{len(self.blocks)}"), left))
        return " ".join(parts)

    def _load(self) -> list[Turn]:
        turns: list[Turn] = []
        with open(self.path) as f:
            for line in f:
                if len(turns) >= self.max_requests:
                    break
                if not line.strip():
                    continue
                rec = json.loads(line)
                text = self.prompt(int(rec["input_length"]), list(rec["hash_ids"]))
                out = max(1, round(int(rec["output_length"]) * self.output_scale))
                at = float(rec["timestamp"]) / 1000 * self.time_scale
                msgs = [{"role": "user", "content": text}]
                turns.append(Turn(len(turns), len(turns), 0, msgs, out, at))
        if not turns:
            raise ValueError(f"--trace: no requests in {self.path}")
        return turns


@dataclass
class Grounded:
    """`n` input-grounded tasks (bench/grounded.py: edits, extractions and summaries of this
    repository's docs and code, whose answers quote their prompt), one request each, all
    released at once (the arrival process paces them). With `as_json` each asks for
    `{"answer": "..."}` and carries that JSON schema as its `response_format`. Send them
    with `--no-ignore-eos`: an answer ends where the model ends it."""

    n: int
    output_len: int
    as_json: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("--num-prompts: must be >= 1")
        if self.output_len < 1:
            raise ValueError("--output-len: must be >= 1")
        extra = {"response_format": grounded.response_format()} if self.as_json else {}
        self.tasks = grounded.tasks(self.n, seed=self.seed)
        self.turns = [Turn(i, i, 0, t.messages(self.as_json), self.output_len, extra=extra)
                      for i, t in enumerate(self.tasks)]  # fmt: skip

    @property
    def total(self) -> int:
        return self.n

    def initial(self) -> list[Turn]:
        return list(self.turns)

    def done(self, turn: Turn, ok: bool, text: str) -> list[Turn]:
        return []
