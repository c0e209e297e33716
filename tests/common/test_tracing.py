"""libs/common/tracing.py: off costs nothing and sends nothing; on, a trace crosses NATS."""

from __future__ import annotations

import pytest

from libs.common import tracing
from libs.common.bus.connection import Bus, Endpoint
from libs.common.config import CommonConfig
from libs.common.messages.control import Message


class Ask(Message, tag="test_trace_ask"):
    request_id: str


class Told(Message, tag="test_trace_told"):
    trace_id: str


def test_off_by_default_no_span_no_header_no_context():
    assert CommonConfig().otlp_endpoint == ""
    assert not tracing.enabled()
    with tracing.span("x", "r1", context=tracing.joined(None)) as span:
        assert span is None
        assert tracing.headers() is None
    assert tracing.remote({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    tracing.shutdown()  # safe with nothing set up


def test_endpoint_from_the_flag_or_opentelemetry_variables():
    assert tracing.endpoint("", {}) == ""
    assert tracing.endpoint("http://c:4318", {}) == "http://c:4318/v1/traces"
    assert tracing.endpoint("http://c:4318/v1/traces", {}) == "http://c:4318/v1/traces"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://o:4318/"}
    assert tracing.endpoint("", env) == "http://o:4318/v1/traces"
    assert tracing.endpoint("http://flag:1", env) == "http://flag:1/v1/traces"
    env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "http://t:9/x"
    assert tracing.endpoint("", env) == "http://t:9/x"


def test_a_bad_endpoint_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--otlp-endpoint"):
        CommonConfig(otlp_endpoint="jaeger:4318")


def test_workers_start_no_trace_of_their_own(exported):
    """Without a trace to join (a request from an untraced router) nothing is recorded."""
    with tracing.span("decode.request", "r1") as span:
        assert span is None
        tracing.record("decode.queue", "r1", 1, 2)
    assert exported.get_finished_spans() == ()


async def test_a_request_over_nats_continues_the_callers_trace(exported, nats_url):
    server, client = (Bus(nats_url, n, 5.0, 2.0) for n in ("srv", "cli"))
    await server.connect()
    await client.connect()

    async def handle(req: Ask) -> Told:
        with tracing.span("inner", req.request_id, step=1) as span:
            assert span is not None
            return Told(trace_id=f"{span.get_span_context().trace_id:032x}")

    try:
        await server.add_service("tandem-t", "0.1.0", "t", [Endpoint("ask", "t.ask", Ask, handle)])
        with tracing.span("root", "r7", context=tracing.joined(None)) as root:
            assert root is not None
            told = await client.request("t.ask", Ask(request_id="r7"), Told)
        trace_id = f"{root.get_span_context().trace_id:032x}"
        assert told.trace_id == trace_id
    finally:
        await client.close()
        await server.close()
    spans = {s.name: s for s in exported.get_finished_spans()}
    assert set(spans) == {"root", "ask", "inner"}
    assert {f"{s.context.trace_id:032x}" for s in spans.values()} == {trace_id}
    assert spans["ask"].parent.span_id == spans["root"].context.span_id  # across NATS
    assert spans["inner"].parent.span_id == spans["ask"].context.span_id
    assert spans["inner"].attributes == {tracing.REQUEST_ID: "r7", "tandem.step": 1}


def test_a_line_logged_inside_a_span_names_its_trace(exported):
    assert tracing.log_ids(None, "info", {}) == {}  # no span: nothing added
    with tracing.span("root", "r9", context=tracing.joined(None)) as root:
        assert root is not None
        line = tracing.log_ids(None, "info", {"event": "x"})
    assert line == {"event": "x", "trace_id": f"{root.get_span_context().trace_id:032x}"}
