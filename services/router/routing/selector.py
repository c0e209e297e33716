"""Glue between the live workers, the KV index and the policy: one route per attempt.

The prompt's page keys are salted with the workers' own (model id, KV dtype, page size),
taken from their load reports, and chained from the request's cache salt
(libs/common/engine/core/kv_hash.py), so the router's keys equal the keys workers publish
and a request of one salt is never routed for another salt's cached prefix.
Workers whose model id differs from the router's are never chosen (their keys, their
tokenizer and their outputs would not match this router's).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Set

from libs.common import tracing
from libs.common.engine.core.kv_hash import PageHasher
from libs.common.log import get_logger
from services.router.metrics import RouterMetrics
from services.router.routing.kv_index import KvIndex, PrefixMatch
from services.router.routing.policy import (
    PolicyConfig,
    Route,
    choose,
    decode_cost,
    prefill_cost,
)
from services.router.routing.workers import Worker, WorkerTable

log = get_logger(__name__)


class RouteSelector:
    """`plan(token_ids, cache_salt)` returns a function `exclude -> Route | None` for the
    dispatcher."""

    def __init__(
        self,
        workers: WorkerTable,
        index: KvIndex,
        policy: PolicyConfig,
        model_id: str,
        metrics: RouterMetrics,
        rng: random.Random | None = None,
    ):
        self.workers, self.index, self.policy = workers, index, policy
        self.model_id, self.metrics = model_id, metrics
        self.rng = rng or random.Random()
        self._hashers: dict[tuple[str, str, int], PageHasher] = {}

    def eligible(self, role: str, exclude: Set[str] = frozenset()) -> list[Worker]:
        # A `both` worker is on both sides: it decodes, and it prefills for the others.
        roles = ("decode", "both") if role == "decode" else ("prefill", "both")
        return [
            w
            for w in self.workers.live(*roles)
            if w.id not in exclude and w.report.model_id == self.model_id
        ]

    def plan(
        self, token_ids: list[int], cache_salt: str = "", request_id: str = ""
    ) -> Callable[[Set[str]], Route | None]:
        """`request_id` names the request in its trace's route spans."""
        keys_by_salt: dict[tuple[str, str, int], list[str]] = {}

        def route(exclude: Set[str]) -> Route | None:
            started = tracing.now()
            # A retry avoids the workers that failed, but a lone decode worker is still
            # tried again (with another prefill worker, or prefilling itself).
            decodes = self.eligible("decode", exclude) or self.eligible("decode")
            if not decodes:
                return None
            # One cluster has one page size and dtype; mixed ones are routed by the first.
            page_size = decodes[0].report.page_size
            salt = (self.model_id, decodes[0].report.kv_dtype, page_size)

            def same(w: Worker) -> bool:
                return (w.report.kv_dtype, w.report.page_size) == salt[1:]

            decodes = [w for w in decodes if same(w)]
            prefills = [w for w in self.eligible("prefill", exclude) if same(w)]
            if salt not in keys_by_salt:
                keys_by_salt[salt] = self._hasher(salt).keys(token_ids, cache_salt=cache_salt)
            match = self.index.match(keys_by_salt[salt], [w.id for w in decodes + prefills])
            chosen = choose(
                len(token_ids), page_size, match, decodes, prefills, self.policy, rng=self.rng
            )
            if chosen is not None:
                self._record(chosen, match)
            if tracing.enabled():
                self._trace(request_id, started, chosen, len(token_ids), match,
                            decodes=decodes, prefills=prefills)  # fmt: skip
            return chosen

        return route

    def _trace(
        self,
        request_id: str,
        started: int,
        chosen: Route | None,
        prompt_len: int,
        match: PrefixMatch,
        *,
        decodes: list[Worker],
        prefills: list[Worker],
    ) -> None:
        """The routing decision as a span: the choice and every candidate's cost."""
        policy, page_size = self.policy, decodes[0].report.page_size
        d = [f"{w.id}={decode_cost(w, policy):.3f}" for w in decodes]
        p = [f"{w.id}={prefill_cost(w, prompt_len, page_size, match, policy):.3f}"
             for w in prefills]  # fmt: skip
        tracing.record(
            "router.route", request_id, started, tracing.now(),
            decode=chosen.decode if chosen else "", prefill=chosen.prefill if chosen else "",
            reason=chosen.reason if chosen else "none",
            cached_pages=chosen.cached_pages if chosen else 0, decode_costs=d, prefill_costs=p,
        )  # fmt: skip

    def _hasher(self, salt: tuple[str, str, int]) -> PageHasher:
        hasher = self._hashers.get(salt)
        if hasher is None:
            hasher = self._hashers[salt] = PageHasher(*salt)
        return hasher

    def _record(self, route: Route, match: PrefixMatch) -> None:
        self.metrics.routed.labels(route.decode, "decode").inc()
        worker = route.prefill or route.decode
        if route.prefill:
            self.metrics.routed.labels(route.prefill, "prefill").inc()
        self.metrics.routed_hit_pages.labels(worker).inc(route.cached_pages)
        log.debug(
            "routed",
            decode=route.decode,
            prefill=route.prefill,
            reason=route.reason,
            cached_pages=route.cached_pages,
            pool_pages=match.pool,
        )
