"""The engine's step loop (`EngineCore`), synchronous: scheduler + model runner + stop
handling, one step at a time; engine.py runs it in a thread for the event loop.

    outputs = core.step()   # schedule -> run -> postprocess

Not thread-safe: one caller at a time (the async Engine serializes calls).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog
import torch

from libs.common.engine.config import EngineConfig
from libs.common.engine.core.batch import ScheduledSeq
from libs.common.engine.core.kv_hash import PageHasher
from libs.common.engine.core.outputs import RequestOutput, TokenLogprobs
from libs.common.engine.core.page_allocator import PageAllocator
from libs.common.engine.core.radix_cache import CacheEvent, RadixCache
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.core.scheduler import Scheduler
from libs.common.engine.core.sequence import FinishReason, Sequence, SequenceStatus
from libs.common.engine.load.source import load_model
from libs.common.engine.load.tokenizer import TextTokenizer
from libs.common.engine.model.attention import backend_class
from libs.common.engine.model.grammar_mask import GrammarMasks
from libs.common.engine.model.kernel_choice import choose_kernels
from libs.common.engine.model.kv_cache import KVCache
from libs.common.engine.model.model import LlamaModel
from libs.common.engine.model.runner import ModelRunner
from libs.common.engine.model.sampler import SamplingRow
from libs.common.engine.request_state import RequestState, check_token_ids
from libs.common.engine.spec.speculator import Speculator, make_speculator
from libs.common.engine.spec.verify import accepted_run, split_runs
from libs.common.grammar.compiler import GrammarCompiler

log = structlog.get_logger(__name__)


class EngineCore:
    """Owns the model, the KV pool and the scheduler of one worker.

    Contract: every public method runs to completion before the next one
    starts (never concurrently with `step`). KV events of the prefix cache
    are queued and handed out by `take_events()`, in order.
    """

    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel | None = None,
        tokenizer: TextTokenizer | None = None,
        kv_allocator: Callable[[int], Any] | None = None,
    ) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if model is None:
            loaded, tokenizer = load_model(config.model, config.weights)
            model = LlamaModel(loaded)
        choose_kernels(model, config.kernel_choice, config.kernel_copy_mb)
        self.model, self.tokenizer = model, tokenizer
        c = model.config
        kv_dtype = config.kv_torch_dtype
        num_pages = config.num_pages or max(
            1,
            config.kv_cache_mb
            * 2**20
            // KVCache.page_nbytes_for(
                c.num_layers, config.page_size, c.num_kv_heads, c.head_dim, kv_dtype
            ),
        )
        self.kv_cache = KVCache(
            c.num_layers,
            num_pages,
            config.page_size,
            c.num_kv_heads,
            c.head_dim,
            dtype=kv_dtype,
            device=config.device,
            allocate=kv_allocator,
        )
        options = (
            {"decode_mirror": config.decode_mirror} if config.attention_backend == "torch" else {}
        )
        attention = backend_class(config.attention_backend)(self.kv_cache, c.num_heads, **options)
        self.runner = ModelRunner(model, attention)
        self._events: list[CacheEvent] = []
        cache = hasher = None
        if config.enable_prefix_cache:
            cache = RadixCache(config.page_size, tier=config.tier, on_event=self._events.append)
            hasher = PageHasher(model.model_id, self.kv_format, config.page_size)
        self.hasher = hasher
        self.scheduler = Scheduler(
            PageAllocator(num_pages),
            page_size=config.page_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            cache=cache,
            hasher=hasher,
            eos_token_ids=c.eos_token_ids,
        )
        self._requests: dict[str, RequestState] = {}
        self.speculator = make_speculator(config, (model, tokenizer), num_pages * config.page_size)
        self._grammars: GrammarCompiler | None = None
        self._masks: GrammarMasks | None = None
        log.info(
            "engine.ready",
            model_id=model.model_id,
            num_pages=num_pages,
            page_size=config.page_size,
            backend=config.attention_backend,
            kv_dtype=config.kv_dtype,
            weights=model.weight_form,
        )

    # -- requests -------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        keep_pages: bool = False,
        matcher: Any = None,
        generated: list[int] | tuple[int, ...] = (),
    ) -> RequestOutput | None:
        """Queue a request. ValueError for a duplicate id, empty or oversized prompt, or a
        grammar that does not compile. `matcher`: the grammar's, compiled already
        (Engine compiles off the event loop), else it is compiled here.

        `generated`: the first tokens of this request's completion, produced elsewhere (a
        request migrated from a dead worker). They follow the prompt and are computed with
        it, but count as output (max_tokens, penalties, the seed's step, usage) and are
        replayed through the grammar and the stop checks first, their text withheld (the
        client has it). Returns a final output without tokens when they already end the
        request, else None."""
        self._check_ids([*token_ids, *generated], params)
        matcher = matcher or self._matcher_for(params)
        seq = Sequence(
            request_id, token_ids, params, prefill_only=prefill_only, keep_pages=keep_pages
        )
        seq.token_ids.extend(generated)
        if not generated:  # a migrated request's client has its prompt logprobs already
            seq.logits_from = params.prompt_logits_from
        self.scheduler.add(seq)
        self._track(seq, matcher)
        if seq.logits_from is not None:
            self._requests[request_id].scores = {}
        return self._replay(self._requests[request_id], list(generated))

    def reserve(
        self, request_id: str, token_ids: list[int], params: SamplingParams,
        reuse_prefix: bool = False, matcher: Any = None,
    ):  # fmt: skip
        """Pages for the prompt's KV, to be filled by a peer; None when the pool is full.
        With `reuse_prefix`, returns (pages, n): the first n pages are cached here already.
        `matcher` as for `add`: it replays the first token when the KV arrives."""
        self._check_ids(token_ids, params)
        matcher = matcher or self._matcher_for(params)
        seq = Sequence(request_id, token_ids, params)
        pages = self.scheduler.reserve(seq, reuse_prefix)
        if pages is not None:
            self._track(seq, matcher)
        if reuse_prefix:
            return None if pages is None else (pages, seq.num_committed_pages)
        return pages

    def add_imported(self, request_id: str, first_token_id: int) -> RequestOutput:
        """The reserved request's prompt KV is in place: decode on from its first token.

        Returns the output for the first token (finished when it already stops). A grammar's
        matcher replays that token: it was sampled under the same grammar, never twice."""
        self.scheduler.add_imported(request_id, first_token_id)
        req = self._requests[request_id]
        req.advance_grammar(first_token_id)
        return self._output(req, first_token_id, None)

    def abort(self, request_id: str, retire_pages: bool = False) -> RequestOutput | None:
        req = self._requests.pop(request_id, None)
        seq = self.scheduler.abort(request_id, retire_pages)
        if self.speculator is not None:
            self.speculator.release(request_id)
        if req is None or seq is None:
            return None
        return RequestOutput(
            request_id,
            [],
            "",
            True,
            FinishReason.ABORT.value,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
        )

    def release(self, request_id: str) -> None:
        """Free the pages of a finished request that kept them."""
        self._requests.pop(request_id, None)
        self.scheduler.release(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def close(self) -> None:
        """Stop the grammar threads (the compiler's and the masks'); safe twice."""
        if self._grammars is not None:
            self._grammars.close()
        if self._masks is not None:
            self._masks.close()

    @property
    def kv_format(self) -> str:
        """What the KV bytes are, for page keys and pairing: the cache's dtype and the form
        of the weights that computed them ("float32/native"): pages computed with other
        weights differ in their last bits and must never be taken for these."""
        return f"{self.kv_cache.dtype_name}/{self.model.weight_form}"

    @property
    def grammars(self) -> GrammarCompiler:
        """This engine's grammar compiler and cache (built on first use)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("a grammar needs the model's tokenizer")
            self._grammars = GrammarCompiler(
                self.tokenizer.tokenizer.to_str(),
                self.model.config.vocab_size,
                tuple(self.model.config.eos_token_ids),
            )
        return self._grammars

    def take_events(self) -> list[CacheEvent]:
        events, self._events[:] = list(self._events), []
        return events

    # -- the loop ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        began = time.perf_counter()
        if self.speculator is not None:
            self._draft(self.speculator)
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        sampling = [item for item in out.scheduled if item.sample]
        reqs = [self._requests[item.seq.request_id] for item in sampling]
        rows: list[SamplingRow] = []
        for item, state in zip(sampling, reqs, strict=True):
            rows += state.rows(self.scheduler.eos_token_ids, item.drafts)
        allowed = None
        if any(req.matcher is not None for req in reqs):
            matchers = [req.matcher for req in reqs]
            allowed = self._mask_maker().start(matchers, [item.drafts for item in sampling])
        result = self.runner.run(out.scheduled, rows, allowed)
        runs = split_runs(sampling, result)
        sampled = {item.seq.request_id: tokens[0] for item, (tokens, _) in zip(sampling, runs,
                   strict=True) if not item.num_drafts}  # fmt: skip
        for request_id, scored in result.prompt_logprobs.items():
            req = self._requests.get(request_id)
            if req is not None and req.scores is not None:
                req.scores.update(scored)
        self.scheduler.postprocess(out, sampled)
        outputs = [self._progress(item.seq) for item in out.scheduled
                   if not item.sample and item.seq.prefill_only]  # fmt: skip
        for item, req, (tokens, lps) in zip(sampling, reqs, runs, strict=True):
            if item.num_drafts:
                outputs.extend(self._take_run(item, req, tokens, lps))
                continue
            req.advance_grammar(tokens[0])
            outputs.append(self._output(req, tokens[0], lps[0]))
        if self.speculator is not None and len(out.scheduled) == 1:
            self.speculator.timed(out.scheduled[0], time.perf_counter() - began)
        return outputs

    def _draft(self, speculator: Speculator) -> None:
        """Drafts for this step's decoding sequences; a grammar cuts them at the first
        token it forbids (verifying those would be wasted)."""
        speculator.draft(self.scheduler.running)
        for seq in self.scheduler.running:
            req = self._requests.get(seq.request_id)
            if seq.draft_ids and req is not None and req.matcher is not None:
                del seq.draft_ids[req.matcher.validate_tokens(seq.draft_ids) :]

    def _take_run(self, item: ScheduledSeq, req: RequestState, tokens, lps) -> list[RequestOutput]:
        """A verified item's outputs: its accepted drafts and the target's token after
        them, one at a time as decoding would emit them (grammar, stop ids and strings,
        max_tokens after each: nothing past a stop)."""
        run = accepted_run(item.drafts, tokens)
        outputs: list[RequestOutput] = []
        for token, lp in zip(run, lps, strict=False):  # lps: every position's
            if not self.scheduler.take_verified(item, token):
                break
            req.advance_grammar(token)
            outputs.append(self._output(req, token, lp))
            if req.seq.is_finished:
                break
        self.scheduler.end_verified(item)
        if self.speculator is not None:
            self.speculator.verified(req.seq, item.num_drafts, len(run) - 1)
        return outputs

    def _progress(self, seq: Sequence) -> RequestOutput:
        """A prefill-only request's chunk is done: its stable pages (full, computed, and no
        longer swapped for cached copies) can move to the decode worker now, while the
        next chunk computes."""
        stable = (
            seq.num_committed_pages
            if self.scheduler.kv.cache is not None
            else seq.num_computed_tokens // self.config.page_size
        )
        out = RequestOutput(seq.request_id, [], "", num_prompt_tokens=seq.num_prompt_tokens)
        out.page_table = list(seq.page_table[:stable])
        out.queue_time = seq.queue_time
        return out

    # -- internals ----------------------------------------------------------------------

    def _check_ids(self, token_ids: list[int], params: SamplingParams) -> None:
        check_token_ids(token_ids, params, self.model.config.vocab_size)

    def _track(self, seq: Sequence, matcher: Any) -> None:
        self._requests[seq.request_id] = RequestState.start(seq, self.tokenizer, matcher)

    def _matcher_for(self, params: SamplingParams) -> Any:
        return self.grammars.matcher(params.grammar) if params.grammar else None

    def _mask_maker(self) -> GrammarMasks:
        if self._masks is None:
            self._masks = GrammarMasks(self.model.config.vocab_size, self.config.num_threads)
        return self._masks

    def _replay(self, req: RequestState, generated: list[int]) -> RequestOutput | None:
        """Bring a migrated request's grammar and stop state to where its first worker
        left them: each token as if just sampled. Only the last one can end the request
        (the client saw the others go by); its end is checked as a sampled token's."""
        if not generated:
            return None
        for token in generated[:-1]:
            req.advance_grammar(token)
            req.stop.step(token, None)
        last = generated[-1]
        req.advance_grammar(last)
        reason = self.scheduler.stop_reason(req.seq)
        if reason is not None:
            self.scheduler.finish(req.seq.request_id, reason)
        out = self._output(req, last, None)
        if not out.finished:
            return None
        out.token_ids, out.text = [], ""  # the client has the token and its text already
        return out

    def _output(self, req: RequestState, token: int, lp: TokenLogprobs | None) -> RequestOutput:
        seq = req.seq
        reason = seq.finish_reason.value if seq.finish_reason is not None else None
        by_grammar = req.grammar_done and reason is None
        delta, by_string = req.stop.step(token, reason, final=by_grammar)
        hit = by_string or by_grammar
        if hit and not seq.is_finished:
            self.scheduler.finish(seq.request_id, FinishReason.STOP)
            reason = FinishReason.STOP.value
        elif hit:
            reason = FinishReason.STOP.value
        finished = seq.is_finished
        out = RequestOutput(
            seq.request_id,
            [token],
            delta,
            finished,
            reason,
            [lp] if lp is not None else [],
            seq.num_prompt_tokens,
            seq.num_cached_tokens,
            seq.num_output_tokens,
        )
        out.queue_time = seq.queue_time
        if finished and reason == FinishReason.STOP.value:
            out.stop_reason = req.stop_reason(token, by_string)
        if req.scores is not None:
            out.prompt_logprobs = req.prompt_logprobs()
        if finished and seq.status == SequenceStatus.HELD:
            out.page_table = list(seq.page_table)
        elif finished:
            self._requests.pop(seq.request_id, None)
        if finished and self.speculator is not None:
            self.speculator.release(seq.request_id)
        return out
