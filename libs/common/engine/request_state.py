"""What the step loop (step_loop.py) keeps per request besides its Sequence: seed, stop
checker, grammar matcher, prompt scores; and what a request asks of the sampler at each
step (`row`).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Collection
from collections.abc import Sequence as SequenceT
from typing import Any

import structlog

from libs.common.engine.core.outputs import TokenLogprobs
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.core.sequence import Sequence
from libs.common.engine.core.stop import StopChecker
from libs.common.engine.model.sampler import SamplingRow

log = structlog.get_logger(__name__)


@dataclasses.dataclass(slots=True)
class RequestState:
    seq: Sequence
    seed: int
    stop: StopChecker
    penalized: bool
    matcher: Any = None  # an llguidance matcher when the request has a grammar
    grammar_done: bool = False  # the matcher is complete (or refused a token): stop
    # prompt logprobs computed so far, by token index, until the first output carries them
    scores: dict[int, TokenLogprobs] | None = None

    @classmethod
    def start(cls, seq: Sequence, tokenizer: Any, matcher: Any) -> RequestState:
        """A new request's state: its seed (drawn when the request names none), its stop
        checker, whether penalties need its tokens."""
        p = seq.sampling_params
        seed = p.seed if p.seed is not None else secrets.randbits(63)
        penalized = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) != (1, 0, 0)
        return cls(seq, seed, StopChecker(p, tokenizer), penalized, matcher)

    def row(self, eos_token_ids: Collection[int]) -> SamplingRow:
        """This step's sampling row. Below min_tokens the tokens that would end the
        request (its stop ids, EOS unless ignore_eos) cannot be sampled."""
        return self._row(eos_token_ids, ())

    def rows(self, eos_token_ids: Collection[int], drafts: SequenceT[int]) -> list[SamplingRow]:
        """The rows of a speculative step: this step's, then the one after each draft, each
        as if the drafts before it had been sampled (output index, penalties, min_tokens),
        so the target's token at every position is the one decoding without drafts
        would sample there."""
        return [self._row(eos_token_ids, drafts[:i]) for i in range(len(drafts) + 1)]

    def _row(self, eos_token_ids: Collection[int], drafted: SequenceT[int]) -> SamplingRow:
        seq, params = self.seq, self.seq.sampling_params
        step = seq.num_output_tokens + len(drafted)
        suppress: tuple[int, ...] = ()
        if step < params.min_tokens:
            eos = () if params.ignore_eos else tuple(eos_token_ids)
            suppress = (*params.stop_token_ids, *eos)
        if self.penalized:
            output = [*seq.output_token_ids, *drafted]
            return SamplingRow(params, self.seed, step, seq.prompt_token_ids, output, suppress)
        return SamplingRow(params, self.seed, step, suppress=suppress)

    def advance_grammar(self, token: int) -> None:
        """The grammar's matcher takes the sampled token; a complete grammar ends the
        request ("stop"). A token it refuses (never sampled under its mask) ends it too."""
        seq, matcher = self.seq, self.matcher
        if matcher is None or seq.prefill_only:
            return  # a prefill-only request samples one token: its matcher has no future
        if not matcher.consume_token(token):
            log.error("grammar.refused_token", request_id=seq.request_id, token=token,
                      error=matcher.get_error())  # fmt: skip
            self.grammar_done = True
        elif matcher.is_stopped():
            self.grammar_done = True

    def stop_reason(self, token: int, hit: bool) -> str | int | None:
        """What ended a request that finished "stop" on `token`: the stop string it hit,
        else the stop token id, else None (EOS, a complete grammar): vLLM's stop_reason."""
        if hit and self.stop.matched is not None:
            return self.stop.matched
        if token in self.seq.sampling_params.stop_token_ids:
            return token
        return None

    def prompt_logprobs(self) -> list[TokenLogprobs]:
        """The prompt's logprobs, for its first output; scoring ends there."""
        seq, scores = self.seq, self.scores or {}
        first = max(seq.sampling_params.prompt_logprobs_from, 1)
        missing = [i for i in range(first, seq.num_prompt_tokens) if i not in scores]
        if missing:  # a bug, never a silent gap: the client would misalign them
            raise RuntimeError(f"{seq.request_id}: prompt tokens {missing[:4]} were not scored")
        self.scores, seq.logits_from = None, None
        return [scores[i] for i in range(first, seq.num_prompt_tokens)]


def check_token_ids(token_ids: list[int], params: SamplingParams, vocab: int) -> None:
    """A request's prompt and the ids its parameters name are the model's: ValueError."""
    if not token_ids:
        raise ValueError("token_ids must not be empty")
    if any(not 0 <= t < vocab for t in token_ids):
        raise ValueError(f"token_ids must be in [0, {vocab})")
    for name, ids in params.token_ids_by_field().items():
        if any(t >= vocab for t in ids):
            raise ValueError(f"'{name}': token ids must be in [0, {vocab})")
