"""bench.tracing: its sink answers the SDK's OTLP exporter as a collector does; the table
compares the rounds' means."""

from __future__ import annotations

import asyncio

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.tracing import Sink, call_sites, cpu_seconds, main, micro, off_bound, table
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
        memory.clear()
        with provider.get_tracer("t").start_as_current_span("two"):
            with provider.get_tracer("t").start_as_current_span("three"):
                pass
        # "three" and "two" in one export, after "one"
        await asyncio.to_thread(exporter.export, [*memory.get_finished_spans()])
        assert sink.requests == 2 and sink.spans() == 3
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


def test_call_sites_counts_the_helper_calls_left_in_services_and_libs(tmp_path):
    (tmp_path / "libs" / "common").mkdir(parents=True)
    (tmp_path / "services" / "router").mkdir(parents=True)
    (tmp_path / "libs" / "common" / "tracing.py").write_text("tracing.span('not counted')\n")
    (tmp_path / "services" / "router" / "a.py").write_text(
        "from libs.common import tracing\n"
        "with tracing.span('x', rid):\n    tracing.annotate(n=1)\n"
        "h = tracing.headers() or tracing.remote(m.headers)\n"
        "k = tracing.SpanKind.SERVER\nother.span('y')\n"
    )
    assert call_sites(tmp_path) == 4
    assert call_sites() > 20  # this repository's own


def test_cpu_seconds_grows_with_work_and_ignores_a_process_gone():
    import os

    before = cpu_seconds([os.getpid()])
    sum(i * i for i in range(2_000_000))
    assert cpu_seconds([os.getpid()]) > before
    assert cpu_seconds([2**22 + 12345]) == 0.0  # above pid_max's default: no such process


def test_the_bound_is_sites_times_tokens_times_a_call_over_cpu_a_request():
    def run(completed: int, cpu_s: float) -> dict:
        stats = {"mean": 1.0}
        summary = {"output_throughput": 1.0, "ttft_ms": stats, "tpot_ms": stats, "e2e_ms": stats,
                   "completed": completed}  # fmt: skip
        return {"summary": summary, "cpu_s": cpu_s, "exports": 1}

    runs = {"off": [run(10, 2.0), run(10, 3.0)], "on": [run(10, 3.0)]}
    bound = off_bound(runs, output_len=31, sites=50, off_call_us=0.5, spans=165)
    assert bound["off_cpu_ms"] == 250.0  # 5 s over 20 requests
    assert bound["off_cost_ms"] == 50 * 32 * 0.5 / 1e3
    assert abs(bound["share"] - 0.8 / 250.0) < 1e-12
    assert bound["spans_per_request"] == 15.0  # 165 spans, 10 requests and the warm-up
    text = table(runs, bound)
    assert "50 call sites x 32 (output tokens + 1)" in text and "0.320% of the off" in text
    cpu = next(line for line in text.splitlines() if line.startswith("CPU ms / request"))
    assert cpu.split()[4:] == ["250.0", "300.0", "1.200"]  # off, on, on / off
