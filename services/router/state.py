"""Everything the HTTP handlers of one router share, in one object (no module globals)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import web

from libs.common.bus.connection import Bus
from libs.common.engine.load.tokenizer import TextTokenizer
from libs.common.grammar.pool import GrammarPool
from services.router.config import RouterConfig
from services.router.defaults import SamplingDefaults
from services.router.dispatch.dispatcher import Dispatcher
from services.router.metrics import RouterMetrics
from services.router.routing.kv_index import KvIndex
from services.router.routing.selector import RouteSelector
from services.router.routing.workers import WorkerTable

T = TypeVar("T")
# Token texts kept for logprobs (state.token_text): a whole vocabulary of most models.
TOKEN_TEXTS = 1 << 18


@dataclass
class RouterState:
    """The router's parts. `pending` counts requests in flight (the 429 bound).

    `instance` is this process's random id (services/router/dispatch/heartbeat.py): with a request's
    router-local id (`new_request_id`) it is the request's key on the workers, so the
    client's X-Request-Id stays a label that no other client's request can collide with.
    """

    config: RouterConfig
    bus: Bus
    tokenizer: TextTokenizer
    model_id: str
    max_model_len: int
    workers: WorkerTable
    index: KvIndex
    selector: RouteSelector
    dispatcher: Dispatcher
    metrics: RouterMetrics
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    created: int = field(default_factory=lambda: int(time.time()))
    pending: int = 0
    replayed: Callable[[], bool] = lambda: False  # the KV index has read the stream
    instance: str = ""
    _ids: itertools.count = field(default_factory=itertools.count)

    def new_request_id(self) -> str:
        """A request id unique within this router process (hex of a counter)."""
        return f"{next(self._ids):x}"

    @functools.cached_property
    def grammars(self) -> GrammarPool:
        """The grammar pool for this model's tokenizer, its workers started (blocking: the
        first use is off the loop, at the router's start)."""
        tok, cfg = self.tokenizer, self.config
        pool = GrammarPool(tok.tokenizer.to_str(), tok.vocab_size, tok.eos_token_ids,
                           workers=cfg.grammar_workers, deadline=cfg.grammar_timeout,
                           log=(cfg.log_level, cfg.log_format))  # fmt: skip
        pool.start()
        return pool

    def close_grammars(self) -> None:
        """Stop the grammar pool's workers, if it was made (blocking)."""
        pool = self.__dict__.get("grammars")
        if pool is not None:
            pool.close()

    def context_len(self) -> int:
        """The smallest context of the live workers (they may be configured below the
        model's own), or the model's when none reports one."""
        lens = [w.report.max_model_len for w in self.workers.live("prefill", "decode", "both")]
        lens = [n for n in lens if n > 0]
        return min([*lens, self.max_model_len]) if lens else self.max_model_len

    @functools.cached_property
    def cpu(self) -> ThreadPoolExecutor:
        """The pool of `cpu_work` (shut down with the service)."""
        threads = self.config.cpu_threads
        return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="router-cpu")

    async def cpu_work(self, work: Callable[[], T]) -> T:
        """`work()` on one of --cpu-threads threads: off the event loop, few at once."""
        return await asyncio.get_running_loop().run_in_executor(self.cpu, work)

    def token_text(self, token_id: int) -> str:
        """One token's text, for logprobs: decoded once per id (an LRU shared by every
        request; thread-safe, so responses can be formatted off the event loop)."""
        return self._token_texts(token_id)

    @functools.cached_property
    def _token_texts(self) -> Callable[[int], str]:
        @functools.lru_cache(maxsize=TOKEN_TEXTS)
        def decode(token_id: int) -> str:
            return self.tokenizer.decode([token_id], skip_special=False)

        return decode


STATE: web.AppKey[RouterState] = web.AppKey("router_state", RouterState)
