"""bench.tracing: its sink answers the SDK's OTLP exporter as a collector does; the table
compares the rounds' means."""

from __future__ import annotations

import asyncio

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.tracing import Sink, main, micro, table
from libs.common import tracing


async def test_the_sink_takes_an_otlp_export_and_counts_it():
    sink = Sink()
    await sink.start()
    try:
        memory = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(memory))
        with provider.get_tracer("t").start_as_current_span("one"):
            pass
        exporter = OTLPSpanExporter(endpoint=f"{sink.url}/v1/traces", timeout=5)
        result = await asyncio.to_thread(exporter.export, memory.get_finished_spans())
        assert result is SpanExportResult.SUCCESS
        assert sink.requests == 1 and sink.bytes > 0
    finally:
        await sink.stop()


def test_the_table_gives_on_over_off_of_each_metric():
    def run(tput: float, ttft: float, exports: int = 0) -> dict:
        stats = {"mean": ttft}
        summary = {"output_throughput": tput, "ttft_ms": stats, "tpot_ms": stats,
                   "e2e_ms": stats, "completed": 4}  # fmt: skip
        return {"summary": summary, "exports": exports}

    text = table({"off": [run(100, 10), run(102, 10)], "on": [run(99, 11, 3), run(97, 11, 2)]})
    tput = next(line for line in text.splitlines() if line.startswith("output tok/s"))
    assert tput.split()[2:] == ["101.0", "98.0", "0.970"]
    assert "completed: {'off': 8, 'on': 8}; exports to the sink (on): 5" in text
    # with the older code's rounds: its column first, and off / before last
    text = table({"before": [run(104, 9)], "off": [run(100, 10)], "on": [run(98, 11, 1)]})
    assert text.splitlines()[0].split() == ["before", "off", "on", "on", "/", "off", "off",
                                            "/", "before"]  # fmt: skip
    tput = next(line for line in text.splitlines() if line.startswith("output tok/s"))
    assert tput.split()[2:] == ["104.0", "100.0", "98.0", "0.980", "0.962"]


def test_before_must_be_a_checkout_of_this_repository(tmp_path, capsys):
    assert main(["--before", str(tmp_path), "--rounds", "1"]) == 2
    assert "not a checkout of this repository" in capsys.readouterr().err


def test_micro_times_a_span_off_and_on_and_leaves_tracing_off():
    out = micro(n=1000)
    assert set(out) == {"off_span_us", "on_span_us"} and all(v > 0 for v in out.values())
    assert not tracing.enabled()
