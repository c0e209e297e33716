"""Stop strings and streamed text of one request.

Stop token ids, EOS and max_tokens are the scheduler's (it sees every token);
stop strings need the detokenized text, so they are found here.
"""

from __future__ import annotations

from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.load.detokenizer import IncrementalDetokenizer
from libs.common.engine.load.tokenizer import TextTokenizer


class StopChecker:
    """Detokenizes a request's output and finds its stop strings.

    Contract: `step(token_id, finish_reason)` is called once per generated
    token with the scheduler's verdict ("stop" when the token is EOS or a stop
    id, "length", or None) and returns (text delta, hit) where `hit` is True
    when a stop string appeared. The text ends just before the first stop
    string; text that could still be the start of one is held back until it
    can't, so a stream never shows part of a stop string. A stop token's own
    text (e.g. <|im_end|>) is not part of the output. `final` says the request
    ends on this token although it is text (a grammar just completed): it is
    kept and everything held back goes out. Stop strings are looked for once the
    request has `min_tokens` tokens, and only where they end in text that came after
    (vLLM's rule); `matched` is the one that was hit.
    """

    def __init__(self, params: SamplingParams, tokenizer: TextTokenizer | None) -> None:
        self._stops = params.stop
        self._detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._sent = 0
        self._min_tokens, self._count = params.min_tokens, 0
        self._floor = 0  # text made before min_tokens: no stop string may end in it
        self.text = ""
        self.matched: str | None = None

    def step(
        self, token_id: int, finish_reason: str | None, final: bool = False
    ) -> tuple[str, bool]:
        self._count += 1
        if self._detok is None:
            return "", False
        if finish_reason != "stop":
            self._detok.push([token_id])
        if finish_reason is not None or final:
            self._detok.flush()
        full = self._detok.text
        hit = False
        if self._count < self._min_tokens:
            self._floor = len(full)
        elif self._stops:
            start = max(0, self._sent - self._hold)
            found = [(i, s) for s in self._stops
                     if (i := full.find(s, max(start, self._floor - len(s) + 1))) >= 0]  # fmt: skip
            if found:
                at, self.matched = min(found)
                full, hit = full[:at], True
        done = hit or finish_reason is not None or final
        end = len(full) if done else max(self._sent, len(full) - self._hold)
        delta = full[self._sent : end]
        self._sent = end
        self.text = full[:end]
        return delta, hit
