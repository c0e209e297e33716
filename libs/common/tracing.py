"""One OpenTelemetry trace per request, across every process it touches.

Off by default. `setup(...)` with an OTLP/HTTP endpoint (--otlp-endpoint, or the standard
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT variables) builds an SDK
tracer provider whose spans leave in batches from the SDK's own thread (never on the event
loop); without one every helper here returns at its first check: no span object, no
context switch, no header on the wire.

The context crosses NATS as a W3C `traceparent` header: `headers()` for a message going
out, `remote(headers)` for one coming in (the bus does both for every request/reply, see
libs/common/bus/connection.py). Every span carries the request id as `tandem.request_id`;
the keyword attributes of `span`, `record` and `annotate` are named `tandem.<keyword>`.
Spans of phases that are only known once they are over (a prefill chunk, the wait for the
first token) are recorded after the fact with their real start and end (`record`).
docs/operations.md, "Traces", lists the spans.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

REQUEST_ID = "tandem.request_id"
_PROPAGATOR = TraceContextTextMapPropagator()
_NO_SPAN: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


class _State:
    tracer: trace.Tracer | None = None
    provider: Any = None  # the SDK's TracerProvider, imported only when tracing is on


def endpoint(flag: str, env: Mapping[str, str] | None = None) -> str:
    """Where spans go: the flag, else OpenTelemetry's variables ("" = tracing off).

    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is the whole URL; OTEL_EXPORTER_OTLP_ENDPOINT a base
    that gets `/v1/traces` (the OTLP/HTTP convention). The flag is a base URL too, unless
    it already ends in `/v1/traces`."""
    env = os.environ if env is None else env
    if flag:
        return flag if flag.rstrip("/").endswith("/v1/traces") else _traces_url(flag)
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    return _traces_url(base) if base else ""


def _traces_url(base: str) -> str:
    return base.rstrip("/") + "/v1/traces"


def setup(service: str, service_id: str, url: str, *, exporter: Any = None) -> bool:
    """Export this process's spans to `url` (OTLP/HTTP protobuf); no-op for "".

    The service name is OTEL_SERVICE_NAME when set, else `tandem-<service>`; the instance
    is the service id. Returns whether tracing is on. `exporter` (a SpanExporter) replaces
    the OTLP one and gets each span as it ends (tests)."""
    if not url and exporter is None:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    attributes = {"service.instance.id": service_id}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = f"tandem-{service}"
    provider = TracerProvider(resource=Resource.create(attributes))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    _State.provider, _State.tracer = provider, provider.get_tracer("tandem")
    return True


def shutdown() -> None:
    """Send what is buffered and stop the exporter (blocking: call it off the loop).
    Safe to call twice and with tracing off."""
    provider, _State.provider, _State.tracer = _State.provider, None, None
    if provider is not None:
        provider.shutdown()


def enabled() -> bool:
    return _State.tracer is not None


def span(
    name: str,
    request_id: str,
    *,
    context: Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    start_ns: int | None = None,
    **attributes: Any,
) -> contextlib.AbstractContextManager[Span | None]:
    """A span around the block, the current one inside it; None when tracing is off or
    when there is no trace to join: only a `context` (a request's root, or a remote
    parent) starts one, so a worker traces only the requests that came with a trace.
    `start_ns` (a `now()` timestamp): it began earlier than the block (work queued then).
    An exception leaving the block is recorded on it and sets its status to error."""
    tracer = _State.tracer
    if tracer is None or (context is None and not _in_trace()):
        return _NO_SPAN
    return tracer.start_as_current_span(name, context, kind, _named(request_id, attributes),
                                        start_time=start_ns or None)  # fmt: skip


def record(name: str, request_id: str, start_ns: int, end_ns: int, **attributes: Any) -> None:
    """A span of a phase already over, child of the current span (`now()` timestamps)."""
    tracer = _State.tracer
    if tracer is None or not _in_trace():
        return
    attributes = _named(request_id, attributes)
    tracer.start_span(name, attributes=attributes, start_time=start_ns).end(end_time=end_ns)


def annotate(**attributes: Any) -> None:
    """Attributes on the current span (what a phase learned: cached tokens, bytes)."""
    if _State.tracer is not None and _in_trace():
        trace.get_current_span().set_attributes({f"tandem.{k}": v for k, v in attributes.items()})


def _in_trace() -> bool:
    return trace.get_current_span().get_span_context().is_valid


def _named(request_id: str, attributes: dict[str, Any]) -> dict[str, Any]:
    return {REQUEST_ID: request_id, **{f"tandem.{k}": v for k, v in attributes.items()}}


def event(name: str, **attributes: Any) -> None:
    """A moment inside the current span (token 0 sent): an event with its timestamp."""
    if _State.tracer is not None and _in_trace():
        trace.get_current_span().add_event(name, {f"tandem.{k}": v for k, v in attributes.items()})


def now() -> int:
    """The span clock (epoch nanoseconds), 0 when tracing is off (nothing reads it then)."""
    return time.time_ns() if _State.tracer is not None else 0


def headers() -> dict[str, str] | None:
    """The current context as NATS headers (`traceparent`), None when there is none."""
    if _State.tracer is None:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier or None


def remote(carrier: Mapping[str, str] | None) -> Context | None:
    """The context a message's headers carry, None without a `traceparent` (or when off)."""
    if _State.tracer is None or not carrier or "traceparent" not in carrier:
        return None
    return _PROPAGATOR.extract(carrier)


def joined(carrier: Mapping[str, str] | None) -> Context:
    """The context of a request's root span: the caller's trace when its headers carry
    one, else a new trace."""
    return remote(carrier) or Context()


def log_ids(
    _logger: Any, _name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """A structlog processor: a line logged inside a span carries its `trace_id` (what to
    search the tracing backend for), when tracing is on."""
    if _State.tracer is not None:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            event_dict.setdefault("trace_id", f"{ctx.trace_id:032x}")
    return event_dict
