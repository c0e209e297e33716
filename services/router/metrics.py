"""The router's Prometheus metrics, named in vLLM's style (`tandem:` instead of `vllm:`).

All live in a per-router `CollectorRegistry` (no process-global state; two routers in one
process, as in tests, do not collide). docs/metrics.md lists them with their meaning.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from libs.common.messages.control import LoadReport

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


class ObservedWorker(Protocol):
    """What the worker gauges read of a live worker (routing/workers.py's `Worker`): the
    metrics stay on the ground floor, below the rooms that count into them."""

    @property
    def id(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def report(self) -> LoadReport: ...
    @property
    def kv_usage(self) -> float: ...


class RouterMetrics:
    """Counters, histograms and gauges of one router; `render()` is the /metrics body."""

    def __init__(self, model_name: str, service_id: str = "", instance: str = ""):
        self.registry = r = CollectorRegistry()
        self.model = model_name
        # Which router this is, among several (docs/operations.md, "Several routers"): the
        # same series from two routers differ by these labels besides the scrape's own.
        self.info = Gauge("tandem:router_info", "1, labelled with this router's ids",
                          ("service_id", "instance"), registry=r)  # fmt: skip
        self.info.labels(service_id, instance).set(1)
        m = ("model_name",)
        self.ttft = Histogram(
            "tandem:time_to_first_token_seconds", "Time to first token", m, buckets=_LATENCY,
            registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "tandem:inter_token_latency_seconds", "Time between two streamed tokens", m,
            buckets=_ITL, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "tandem:e2e_request_latency_seconds", "Request latency, arrival to last token", m,
            buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.queue = Histogram(
            "tandem:request_queue_time_seconds", "Routing plus admission by the decode worker",
            m, buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.success = Counter(
            "tandem:request_success", "Finished requests", (*m, "finished_reason"), registry=r
        )
        self.failure = Counter(
            "tandem:request_failure", "Requests answered with an error", (*m, "status"),
            registry=r,
        )  # fmt: skip
        self.migrations = Counter(
            "tandem:request_migrations", "Requests continued on another decode worker after "
            "theirs failed mid-stream", m, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens", m, registry=r)
        self.generation_tokens = Counter(
            "tandem:generation_tokens", "Generated tokens", m, registry=r
        )
        self.cache_queries = Counter(
            "tandem:prefix_cache_queries", "Prompt tokens looked up in prefix caches", m,
            registry=r,
        )  # fmt: skip
        self.cache_hits = Counter(
            "tandem:prefix_cache_hits", "Prompt tokens served from a cache, by tier",
            (*m, "tier"), registry=r,
        )  # fmt: skip
        self.running = Gauge(
            "tandem:num_requests_running", "Requests in flight at the router", m, registry=r
        )
        self.routed = Counter(
            "tandem:router_decisions", "Requests routed, by worker and role", ("worker", "role"),
            registry=r,
        )  # fmt: skip
        self.routed_hit_pages = Counter(
            "tandem:router_expected_cached_pages", "Prompt pages the index said were cached",
            ("worker",), registry=r,
        )  # fmt: skip
        w = ("worker", "role")
        self.w_running = Gauge("tandem:worker_num_requests_running", "Running", w, registry=r)
        self.w_waiting = Gauge("tandem:worker_num_requests_waiting", "Waiting", w, registry=r)
        self.w_kv = Gauge("tandem:worker_kv_cache_usage_perc", "KV pool use, 0-1", w, registry=r)
        self.w_tps = Gauge("tandem:worker_tokens_per_second", "Tokens per second", w, registry=r)
        self.index_keys = Gauge("tandem:kv_index_keys", "Page keys in the KV index", registry=r)
        self.admission_running = Gauge(
            "tandem:router_admitted_slots", "Worker slots held by admitted requests", registry=r
        )
        self.admission_queued = Gauge(
            "tandem:router_queued_requests", "Requests waiting in the tenants' queues",
            registry=r,
        )  # fmt: skip
        self.admission_tps = Gauge(
            "tandem:router_measured_tokens_per_second",
            "Throughput the admission's expected wait divides by", registry=r,
        )  # fmt: skip
        # HTTP connections (api/connections.py): open ones, and those a limit closed.
        self.connections = Gauge("tandem:http_connections", "Open HTTP connections", registry=r)
        self.connections_refused = Counter(
            "tandem:http_connections_refused", "HTTP connections answered and closed by a "
            "limit, by the limit's flag", ("limit",), registry=r,
        )  # fmt: skip

    def observe_worker(self, w: ObservedWorker) -> None:
        labels = (w.id, w.role)
        self.w_running.labels(*labels).set(w.report.running)
        self.w_waiting.labels(*labels).set(w.report.waiting)
        self.w_kv.labels(*labels).set(w.kv_usage)
        self.w_tps.labels(*labels).set(w.report.tokens_per_s)

    def forget_worker(self, w: ObservedWorker) -> None:
        for gauge in (self.w_running, self.w_waiting, self.w_kv, self.w_tps):
            try:
                gauge.remove(w.id, w.role)
            except KeyError:
                pass

    def finished(self, reason: str, prompt: int, completion: int, cached: dict[str, int]):
        self.success.labels(self.model, reason).inc()
        self.prompt_tokens.labels(self.model).inc(prompt)
        self.generation_tokens.labels(self.model).inc(completion)
        self.cache_queries.labels(self.model).inc(prompt)
        for tier, n in cached.items():
            self.cache_hits.labels(self.model, tier).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
