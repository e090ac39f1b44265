"""Span export: batched on a thread of its own, bounded, keeping server faults and time-outs.

Spans go to the exporter (OTLP) from a background thread through a bounded
queue, so a slow or unreachable collector costs the request path nothing;
spans beyond the queue, or in a batch the collector did not take, are dropped
and counted (`classify_trace_spans_dropped_total`). Spans of unsampled traces
are held per trace until the process's part of the trace ends: a server fault
or a `timeout` mark exports everything held for that trace, and the rest is
discarded (classify_common.tracing installs this processor).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from classify_common.errors import SERVER_FAULT_CODES

log = logging.getLogger(__name__)

# Spans waiting for export before new ones are dropped; how often and how long
# the exporter thread sends them (OTEL_BSP_* override them: otel_environment).
EXPORT_QUEUE_SIZE = 4096
EXPORT_DELAY_MILLIS = 1000
EXPORT_TIMEOUT_MILLIS = 5000
EXPORT_BATCH_SIZE = 512
# Unsampled traces whose spans are held in case one turns out an error or a time-out.
HELD_TRACES = 2048
HELD_SPANS_PER_TRACE = 64
KEPT_TRACES = 4096
SPANS_DROPPED_TOTAL = "classify_trace_spans_dropped_total"
HELD_TRACES_NOW = "classify_trace_held_traces"
SERVER_FAULT_NAMES = frozenset(code.name for code in SERVER_FAULT_CODES)


class ExportDrops:
    """Spans lost on the way to the collector, by reason (queue_full, export_failed,
    held_overflow), and the unsampled traces held now (`held_traces`, set by the
    exporter that holds them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_reason: collections.Counter[str] = collections.Counter()
        self.held_traces: Callable[[], int] = lambda: 0

    def add(self, reason: str, count: int) -> None:
        with self._lock:
            self.by_reason[reason] += count

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """A prometheus_client collector: register it on a server's registry."""
        family = CounterMetricFamily(
            SPANS_DROPPED_TOTAL,
            "Spans not exported: the export queue was full, the collector refused them, or "
            "a kept trace had more spans than were held for it.",
            labels=["reason"],
        )
        with self._lock:
            for reason in ("queue_full", "export_failed", "held_overflow"):
                family.add_metric([reason], self.by_reason[reason])
        yield family
        # A span that ends after its part of the trace did (work a cancelled call left
        # running) starts an entry nothing lets go of but the cap's eviction: this
        # says how close to HELD_TRACES the process runs.
        yield GaugeMetricFamily(
            HELD_TRACES_NOW,
            f"Unsampled traces whose spans are held in case the trace is kept (at most "
            f"{HELD_TRACES}, {HELD_SPANS_PER_TRACE} spans each).",
            value=self.held_traces(),
        )


# One exporter per process, so one count per process.
EXPORT_DROPS = ExportDrops()


@dataclass(frozen=True)
class ExportLimits:
    """The batch span processor's settings, named as OTEL_BSP_* names them."""

    # Spans waiting for export before new ones are dropped; default 4096, >= 1.
    queue_size: int = EXPORT_QUEUE_SIZE
    # Milliseconds between exports of a batch that is not full; default 1000, >= 0.
    delay_millis: int = EXPORT_DELAY_MILLIS
    # Milliseconds one export may take; default 5000, >= 1.
    timeout_millis: int = EXPORT_TIMEOUT_MILLIS
    # Spans per export; default 512, 1..queue_size.
    batch_size: int = EXPORT_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.queue_size < 1 or self.timeout_millis < 1 or self.delay_millis < 0:
            raise ValueError(f"queue size, timeout must be >= 1 and delay >= 0: {self}")
        if not 1 <= self.batch_size <= self.queue_size:
            raise ValueError(f"batch size {self.batch_size} is outside 1..{self.queue_size}")

    @property
    def timeout_seconds(self) -> float:
        return self.timeout_millis / 1000


def _keeps_trace(span: ReadableSpan, status_code_key: str, timeout_key: str) -> bool:
    """Whether `span` keeps its unsampled trace: a time-out, or error status that
    is the server's fault. A client span has error status for any failed call (as
    the conventions say), so there its gRPC code decides: a call the next hop
    refused (NOT_FOUND, INVALID_ARGUMENT, ...) keeps nothing."""
    attributes = span.attributes or {}
    if attributes.get(timeout_key):
        return True
    if span.status.status_code != StatusCode.ERROR:
        return False
    if span.kind is SpanKind.CLIENT:
        code = attributes.get(status_code_key)
        return code is None or code in SERVER_FAULT_NAMES
    return True


class KeepingBatchExport(SpanProcessor):
    """Exports sampled spans, and unsampled traces that had an error or a time-out,
    in batches from a background thread through a bounded, counted queue."""

    def __init__(
        self,
        exporter: SpanExporter,
        drops: ExportDrops = EXPORT_DROPS,
        limits: ExportLimits = ExportLimits(),
    ) -> None:
        # NOTE: imported here, not at the top: nodes imports tracing, which imports this.
        from classify_common.nodes import RPC_RESPONSE_STATUS_CODE, TIMEOUT_ATTRIBUTE

        self._status_code_key = RPC_RESPONSE_STATUS_CODE
        self._timeout_key = TIMEOUT_ATTRIBUTE
        self._exporter = exporter
        self._limits = limits
        self._drops = drops
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._ready = threading.Condition()
        self._stopping = False
        # Unsampled traces, oldest first: trace ID -> its spans so far in this process.
        self._held: collections.OrderedDict[int, list[ReadableSpan]] = collections.OrderedDict()
        # Held traces past HELD_SPANS_PER_TRACE: how many of their spans were not held,
        # counted as dropped (held_overflow) if the trace is kept after all.
        self._overflowed: dict[int, int] = {}
        self._kept: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._held_lock = threading.Lock()
        drops.held_traces = lambda: len(self._held)
        self._thread = threading.Thread(target=self._export_loop, name="span-export", daemon=True)
        self._thread.start()

    def on_end(self, span: ReadableSpan) -> None:
        context = span.context
        if context is None:
            return
        if context.trace_flags.sampled:
            self._enqueue([span])
            return
        self._enqueue(self._keep_or_hold(span, context.trace_id))

    def _keep_or_hold(self, span: ReadableSpan, trace_id: int) -> list[ReadableSpan]:
        """The spans to export now: this one (and those held before it) if its trace
        is kept, else none (it is held, or dropped with its trace)."""
        with self._held_lock:
            if trace_id in self._kept or _keeps_trace(
                span, self._status_code_key, self._timeout_key
            ):
                self._kept[trace_id] = None
                self._kept.move_to_end(trace_id)
                while len(self._kept) > KEPT_TRACES:
                    self._kept.popitem(last=False)
                overflowed = self._overflowed.pop(trace_id, 0)
                if overflowed:
                    self._drops.add("held_overflow", overflowed)
                return [*self._held.pop(trace_id, []), span]
            held = self._held.setdefault(trace_id, [])
            if len(held) < HELD_SPANS_PER_TRACE:
                held.append(span)
            else:
                self._overflowed[trace_id] = self._overflowed.get(trace_id, 0) + 1
            while len(self._held) > HELD_TRACES:
                evicted, _ = self._held.popitem(last=False)
                self._overflowed.pop(evicted, None)
            # This process's part of the trace is over, and it went well: let it go.
            if span.parent is None or span.parent.is_remote:
                self._held.pop(trace_id, None)
                self._overflowed.pop(trace_id, None)
            return []

    def _enqueue(self, spans: list[ReadableSpan]) -> None:
        if not spans:
            return
        with self._ready:
            room = self._limits.queue_size - len(self._queue)
            if room < len(spans):
                self._drops.add("queue_full", len(spans) - max(room, 0))
                spans = spans[: max(room, 0)]
            was_idle = not self._queue
            self._queue.extend(spans)
            # The first span wakes the idle loop (to wait out the delay); a full batch
            # cuts the delay short.
            if was_idle or len(self._queue) >= self._limits.batch_size:
                self._ready.notify()

    def _export_loop(self) -> None:
        batch_size = self._limits.batch_size
        while True:
            with self._ready:
                # Idle, nothing to wake for but a span or the stop: with
                # OTEL_BSP_SCHEDULE_DELAY=0 a timed wait here spun a whole core.
                while not self._stopping and not self._queue:
                    self._ready.wait()
                if not self._stopping and len(self._queue) < batch_size:
                    self._ready.wait(self._limits.delay_millis / 1000)
                batch = [self._queue.popleft() for _ in range(min(batch_size, len(self._queue)))]
                stopping = self._stopping and not self._queue
            if batch:
                self._export(batch)
            if stopping:
                return

    def _export(self, batch: list[ReadableSpan]) -> None:
        try:
            result = self._exporter.export(batch)
        except Exception:
            log.exception("span export failed")
            result = SpanExportResult.FAILURE
        if result != SpanExportResult.SUCCESS:
            self._drops.add("export_failed", len(batch))

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        with self._ready:
            batch = list(self._queue)
            self._queue.clear()
        if batch:
            self._export(batch)
        return True

    def shutdown(self) -> None:
        with self._ready:
            self._stopping = True
            self._ready.notify()
        self._thread.join(self._limits.timeout_seconds * 2)
        self._exporter.shutdown()
