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

from libs.common.engine.core.kv_hash import PageHasher
from libs.common.log import get_logger
from services.router.metrics import RouterMetrics
from services.router.routing.kv_index import KvIndex, PrefixMatch
from services.router.routing.policy import PolicyConfig, Route, choose
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
        self, token_ids: list[int], cache_salt: str = ""
    ) -> Callable[[Set[str]], Route | None]:
        keys_by_salt: dict[tuple[str, str, int], list[str]] = {}

        def route(exclude: Set[str]) -> Route | None:
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
            return chosen

        return route

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
