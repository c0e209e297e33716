"""A small OTLP/HTTP trace receiver for tests: what a collector would get, decoded.

It listens on 127.0.0.1 (a port of its own), takes `POST /v1/traces` bodies as OTLP's
protobuf `ExportTraceServiceRequest` (opentelemetry-proto's generated classes) and keeps
every span with its service name. The services under test export to it through the real
SDK exporter (--otlp-endpoint).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: tuple[str, ...] = ()  # their names, in order


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(
                    ReceivedSpan(
                        service=resource.get("service.name", ""),
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        name=s.name,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        events=tuple(e.name for e in s.events),
                    )
                )
    return spans


class OtlpReceiver:
    """`url` is the base to give --otlp-endpoint; `spans` what arrived so far."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.bad_requests = 0
        lock, spans, receiver = threading.Lock(), self.spans, self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    assert self.path == "/v1/traces", self.path
                    got = decode(body)
                except Exception:
                    receiver.bad_requests += 1
                    self.send_response(400)
                    self.end_headers()
                    return
                with lock:
                    spans.extend(got)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in list(self.spans) if s.trace_id == trace_id]

    async def wait_for(self, predicate, timeout: float = 60.0) -> bool:
        """Poll (bounded by `timeout`) until `predicate()` holds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            await asyncio.sleep(0.2)
        return bool(predicate())


def gaps(root: ReceivedSpan, spans: list[ReceivedSpan]) -> list[tuple[int, int]]:
    """The stretches of `root` (start, end ns) that no other span of `spans` covers,
    longest first: the time of the request no phase accounts for."""
    inside = sorted(
        (max(s.start_ns, root.start_ns), min(s.end_ns, root.end_ns))
        for s in spans
        if s.span_id != root.span_id and s.end_ns > root.start_ns and s.start_ns < root.end_ns
    )
    found, reached = [], root.start_ns
    for start, end in inside:
        if start > reached:
            found.append((reached, start))
        reached = max(reached, end)
    if reached < root.end_ns:
        found.append((reached, root.end_ns))
    return sorted(found, key=lambda g: g[0] - g[1])
