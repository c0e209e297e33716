"""Grammar texts compiled against one tokenizer, once per distinct text.

    compiler = GrammarCompiler(tokenizer_json, vocab_size, eos_token_ids)
    compiler.check(grammar)              # GrammarError when it cannot be enforced
    matcher = compiler.matcher(grammar)  # a fresh llguidance matcher for one request
    matcher = await compiler.matcher_async(grammar)   # the same, off the event loop

The cache is keyed by the text's hash and holds a compiled matcher in its start state per
grammar; each request gets a deep copy (cheap: the lexer and parser tables are shared).
Compiles of the same text at the same time share one compile. llguidance drops the GIL
while it compiles, so the event loop keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time

import llguidance
import xxhash

from libs.common.grammar.build import GrammarError
from libs.common.log import get_logger

log = get_logger(__name__)


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer. Thread-safe.

    `tokenizer_json` is a Hugging Face `tokenizers` JSON (Tokenizer.to_str()); `vocab_size`
    is the width of the logits the masks are for (tokens past the tokenizer's vocabulary
    are never allowed); `max_entries` bounds the cache (least recently used goes first).
    """

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        max_entries: int = 256,
    ) -> None:
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self.limits = llguidance.LLParserLimits(verbose_errors=False)
        self._cache: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._inflight: dict[str, concurrent.futures.Future] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar")
        self.compiles = 0  # distinct compiles done (a cache miss each)

    @staticmethod
    def key(grammar: str) -> str:
        return xxhash.xxh3_128_hexdigest(grammar.encode())

    def check(self, grammar: str, param: str = "grammar") -> None:
        """Compile (or find compiled) `grammar`; GrammarError naming `param` if it fails."""
        self._compiled(grammar, param)

    def matcher(self, grammar: str, param: str = "grammar") -> llguidance.LLMatcher:
        """A matcher in the grammar's start state, for one request."""
        return self._compiled(grammar, param).deep_copy()

    async def check_async(self, grammar: str, param: str = "grammar") -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self.check, grammar, param)

    async def matcher_async(self, grammar: str, param: str = "grammar") -> llguidance.LLMatcher:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self.matcher, grammar, param
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compiled(self, grammar: str, param: str) -> llguidance.LLMatcher:
        key = self.key(grammar)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            waiting = self._inflight.get(key)
            if waiting is None:
                self._inflight[key] = concurrent.futures.Future()
        if waiting is not None:
            return waiting.result()
        future = self._inflight[key]
        try:
            matcher = self._compile(grammar, param)
        except BaseException as e:
            future.set_exception(e)
            with self._lock:
                del self._inflight[key]
            raise
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
            del self._inflight[key]
        future.set_result(matcher)
        return matcher

    def _compile(self, grammar: str, param: str) -> llguidance.LLMatcher:
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(param, _one_line(matcher.get_error()))
        self.compiles += 1
        log.debug("grammar.compiled", ms=round((time.perf_counter() - started) * 1e3, 2))
        return matcher


def _one_line(message: str) -> str:
    """llguidance's message on one line, bounded (it quotes the offending source)."""
    text = " ".join(message.split()) or "invalid grammar"
    return text if len(text) <= 500 else text[:497] + "..."
