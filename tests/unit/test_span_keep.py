"""Unsampled traces are kept for the server's faults and time-outs, not refused calls."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, AlwaysRecordSampler
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry

from classify_common.nodes import RPC_RESPONSE_STATUS_CODE, TIMEOUT_ATTRIBUTE
from classify_common.span_export import (
    HELD_SPANS_PER_TRACE,
    HELD_TRACES_NOW,
    SPANS_DROPPED_TOTAL,
    ExportDrops,
    ExportLimits,
    KeepingBatchExport,
)


@pytest.mark.parametrize(
    ("kind", "code", "status", "timeout", "kept"),
    [
        # A client span has error status for any failed call; its code decides.
        (SpanKind.CLIENT, grpc.StatusCode.NOT_FOUND, StatusCode.ERROR, False, False),
        (SpanKind.CLIENT, grpc.StatusCode.INVALID_ARGUMENT, StatusCode.ERROR, False, False),
        (SpanKind.CLIENT, grpc.StatusCode.UNAVAILABLE, StatusCode.ERROR, False, True),
        (SpanKind.CLIENT, None, StatusCode.ERROR, False, True),
        # Elsewhere error status is set only for the server's faults.
        (SpanKind.INTERNAL, grpc.StatusCode.INTERNAL, StatusCode.ERROR, False, True),
        (SpanKind.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT, StatusCode.UNSET, False, False),
        (SpanKind.INTERNAL, None, StatusCode.UNSET, True, True),
    ],
)
def test_an_unsampled_trace_is_kept_only_for_a_fault_or_a_timeout(
    kind: SpanKind,
    code: grpc.StatusCode | None,
    status: StatusCode,
    timeout: bool,
    kept: bool,
) -> None:
    exporter = InMemorySpanExporter()
    processor = KeepingBatchExport(exporter, drops=ExportDrops())
    provider = TracerProvider(sampler=AlwaysRecordSampler(ALWAYS_OFF))
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")

    with (
        tracer.start_as_current_span("server", kind=SpanKind.SERVER),
        tracer.start_as_current_span("node", kind=kind) as span,
    ):
        span.set_status(Status(status))
        if code is not None:
            span.set_attribute(RPC_RESPONSE_STATUS_CODE, code.name)
        if timeout:
            span.set_attribute(TIMEOUT_ATTRIBUTE, True)
    processor.force_flush()
    provider.shutdown()

    names = sorted(span.name for span in exporter.get_finished_spans())
    assert names == (["node", "server"] if kept else [])


def test_spans_held_past_a_traces_cap_are_counted_when_it_is_kept() -> None:
    """80 spans of an unsampled trace, then a fault: the 64 held are exported with the
    fault, and the 16 that were not held are counted as dropped (held_overflow)."""
    exporter = InMemorySpanExporter()
    drops = ExportDrops()
    processor = KeepingBatchExport(exporter, drops=drops)
    provider = TracerProvider(sampler=AlwaysRecordSampler(ALWAYS_OFF))
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")

    with tracer.start_as_current_span("server", kind=SpanKind.SERVER):
        for index in range(80):
            with tracer.start_as_current_span(f"item-{index}"):
                pass
        with tracer.start_as_current_span("fault") as fault:
            fault.set_status(Status(StatusCode.ERROR))
    processor.force_flush()
    provider.shutdown()

    names = [span.name for span in exporter.get_finished_spans()]
    assert len(names) == HELD_SPANS_PER_TRACE + 2  # the held, the fault, the server's
    assert drops.by_reason == {"held_overflow": 80 - HELD_SPANS_PER_TRACE}
    registry = CollectorRegistry()
    registry.register(drops)
    dropped = registry.get_sample_value(SPANS_DROPPED_TOTAL, {"reason": "held_overflow"})
    assert dropped == 80 - HELD_SPANS_PER_TRACE


def test_the_unsampled_traces_held_are_a_gauge() -> None:
    """A span that ends after its trace's part in this process did (work a cancelled
    call left running) starts an entry only the cap's eviction lets go of: the soak
    audit could not see from /metrics how close to the cap a process runs."""
    drops = ExportDrops()
    processor = KeepingBatchExport(InMemorySpanExporter(), drops=drops)
    provider = TracerProvider(sampler=AlwaysRecordSampler(ALWAYS_OFF))
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")
    registry = CollectorRegistry()
    registry.register(drops)

    for _ in range(3):
        with tracer.start_as_current_span("server", kind=SpanKind.SERVER):
            late = tracer.start_span("late")  # a child that outlives its server span
        late.end()
    with (
        tracer.start_as_current_span("server", kind=SpanKind.SERVER),
        tracer.start_as_current_span("in-time"),
    ):
        pass
    held = registry.get_sample_value(HELD_TRACES_NOW)
    provider.shutdown()
    assert held == 3


def _thread_cpu_seconds(native_id: int) -> float:
    """User and system CPU time of one of this process's threads, from /proc."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_with_no_delay_between_exports_the_idle_export_thread_sleeps() -> None:
    """OTEL_BSP_SCHEDULE_DELAY=0 (export each span at once) is allowed; the idle loop
    waited `delay` for spans in a loop, and spun a whole core while nothing came."""
    exporter = InMemorySpanExporter()
    processor = KeepingBatchExport(
        exporter, drops=ExportDrops(), limits=ExportLimits(delay_millis=0)
    )
    try:
        native_id = processor._thread.native_id
        assert native_id is not None
        before = _thread_cpu_seconds(native_id)
        time.sleep(1.0)
        idle_cpu = _thread_cpu_seconds(native_id) - before
        provider = TracerProvider()
        provider.add_span_processor(processor)
        provider.get_tracer("test").start_span("one").end()
        deadline = time.monotonic() + 10
        while not exporter.get_finished_spans() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        processor.shutdown()
    # A spinning thread got a core's share of the second (0.3 s or more even with the
    # machine busy); a sleeping one, nothing a clock tick can show.
    assert idle_cpu < 0.05
    assert [span.name for span in exporter.get_finished_spans()] == ["one"]
