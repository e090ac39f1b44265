"""Structured logs: one JSON object per line, carrying the request and trace IDs.

Records are formatted on the calling thread (so contextvars such as the request
ID are read where the record was made) and written by a background thread
through a bounded queue. The event loop therefore never blocks on a slow or
full stderr (a pipe nobody reads, a stalled log shipper); when the queue is
full, records are dropped and counted instead.

The writer wakes every LOG_FLUSH_SECONDS and writes all queued lines at once,
rather than waking per record: at a few hundred requests a second, a wake-up per
line was a thread competing with the serving loop and the device threads for
the GIL a few hundred times a second.

A line written on every call (the request lifecycle's access line) goes through
`log_event`: once configure_logging has set up the process, it formats the line
straight from its fields, skipping the LogRecord that `logging` builds per call
(the caller's frame, thread and process names) and its handler chain, which cost
as much again as the JSON itself.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TextIO

from prometheus_client.core import CounterMetricFamily

from classify_common.context import current_request

# Lines waiting for the writer thread before new ones are dropped.
LOG_QUEUE_CAPACITY = 10_000
LOG_LINES_DROPPED_TOTAL = "classify_log_lines_dropped_total"
# How often the writer thread writes what is queued; the most a line waits.
LOG_FLUSH_SECONDS = 0.05

# Attributes every LogRecord has; anything else passed via `extra=` is a field.
_STANDARD_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None)))


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str, process_fields: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self._service = service
        # Fields on every line of this process (an orchestrator worker's index, so the
        # lines of several workers sharing one stderr can be told apart).
        self._process_fields = dict(process_fields or {})
        # The timestamp's whole-second part, made once per second: (second, text).
        self._second: tuple[int, str] = (-1, "")

    def format(self, record: logging.LogRecord) -> str:
        entry = self._entry(record.created, record.levelname, record.name, record.getMessage())
        entry.update(
            (key, value)
            for key, value in vars(record).items()
            if key not in _STANDARD_RECORD_ATTRS and not key.startswith("_")
        )
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return _JSON.encode(entry)

    def format_event(
        self, created: float, level: str, logger: str, event: str, fields: Mapping[str, Any]
    ) -> str:
        """The line `format` makes of a record with these attributes and `extra=fields`."""
        entry = self._entry(created, level, logger, event)
        entry.update(fields)
        return _JSON.encode(entry)

    def _entry(self, created: float, level: str, logger: str, event: str) -> dict[str, Any]:
        second = int(created)
        # Read once: another thread may replace it for another second meanwhile.
        cached = self._second
        if cached[0] != second:
            cached = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
            self._second = cached
        entry: dict[str, Any] = {
            "ts": f"{cached[1]}.{int((created - second) * 1000):03d}Z",
            "level": level.lower(),
            "service": self._service,
            "logger": logger,
            "event": event,
        }
        if self._process_fields:
            entry.update(self._process_fields)
        request = current_request()
        if request is not None:
            entry["request_id"] = request.request_id
            entry["trace_id"] = request.trace_id
        return entry


# What json.dumps(entry, default=str) would build on every call.
_JSON = json.JSONEncoder(default=str)


class LineQueue:
    """Lines waiting for the writer thread, at most `capacity` of them.

    A deque without a lock: its append and popleft are atomic, so callers on any
    thread add lines and the writer takes them; a queue.Queue's lock and condition
    cost several times the append, on every line. Threads that add at the same
    moment may overshoot `capacity` by one line each.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lines: collections.deque[str] = collections.deque()

    def __len__(self) -> int:
        return len(self._lines)

    def offer(self, line: str) -> bool:
        """Add `line` unless the queue is full; whether it was added."""
        if len(self._lines) >= self.capacity:
            return False
        self._lines.append(line)
        return True

    def take_all(self) -> list[str]:
        """Every line queued so far, oldest first."""
        lines = []
        with contextlib.suppress(IndexError):
            while True:
                lines.append(self._lines.popleft())
        return lines


class DroppingQueueHandler(logging.Handler):
    """Formats on the caller's thread, queues the line without waiting, counts what it drops."""

    def __init__(self, lines: LineQueue) -> None:
        super().__init__()
        self.queue = lines
        self.dropped = 0
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        # Formatted now: contextvars and mutable args belong to this thread.
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self.put_line(line)

    def put_line(self, line: str) -> None:
        """Queue a formatted line, or count it dropped when the queue is full."""
        if not self.queue.offer(line):
            with self._lock:
                self.dropped += 1


class LogDrops:
    """A prometheus_client collector of the log lines `handler()` dropped (its queue to
    stderr full): register it on a server's registry."""

    def __init__(self, handler: Callable[[], DroppingQueueHandler | None]) -> None:
        self._handler = handler

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            LOG_LINES_DROPPED_TOTAL,
            "Log lines dropped because the queue to stderr was full.",
        )
        handler = self._handler()
        family.add_metric([], handler.dropped if handler is not None else 0)
        yield family


class BatchingLineWriter:
    """A thread that writes queued lines to `stream` every `interval` seconds, all at once."""

    def __init__(self, lines: LineQueue, stream: TextIO, interval: float) -> None:
        self._lines = lines
        self._stream = stream
        self._interval = interval
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Write what is queued and end the thread."""
        if self._thread.is_alive():
            self._stopping.set()
            self._thread.join()

    def _run(self) -> None:
        while not self._stopping.wait(self._interval):
            self.write_queued()
        self.write_queued()

    def write_queued(self) -> None:
        lines = self._lines.take_all()
        if not lines:
            return
        # A closed or broken stderr must not end the thread: the lines are lost
        # either way, and the next interval may find it writable again.
        with contextlib.suppress(OSError, ValueError):
            self._stream.write("\n".join(lines) + "\n")
            self._stream.flush()


_writer: BatchingLineWriter | None = None
# The handler and formatter configure_logging installed on the root logger.
_handler: DroppingQueueHandler | None = None
# The process's dropped log lines, for its /metrics (see configure_logging).
LOG_DROPS = LogDrops(lambda: _handler)
_formatter: JsonFormatter | None = None


def configure_logging(
    service: str, level: str = "INFO", process_fields: Mapping[str, Any] | None = None
) -> DroppingQueueHandler:
    """JSON lines to stderr for the whole process, written off the caller's thread,
    each with `process_fields` added.

    Servers call this once in main; it returns the handler so the drop count can
    be exported.
    """
    global _writer, _handler, _formatter
    if _writer is not None:
        _writer.stop()
    lines = LineQueue(LOG_QUEUE_CAPACITY)
    handler = DroppingQueueHandler(lines)
    formatter = JsonFormatter(service, process_fields)
    handler.setFormatter(formatter)
    _handler, _formatter = handler, formatter
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    _writer = BatchingLineWriter(lines, sys.stderr, LOG_FLUSH_SECONDS)
    _writer.start()
    # Write what is queued when the process exits normally.
    atexit.register(_writer.stop)
    return handler


def log_event(logger: logging.Logger, event: str, fields: Mapping[str, Any]) -> None:
    """Log `event` at INFO with `fields`: the line `logger.info(event, extra=fields)`
    writes, for lines written on every call (see the module docstring).

    It takes the short way only while the record would reach nothing but the handler
    configure_logging installed; otherwise (a test's handler, a filter) it logs.
    """
    handler, formatter = _handler, _formatter
    if (
        handler is None
        or formatter is None
        or not logger.isEnabledFor(logging.INFO)
        or not _reaches_only(logger, handler)
    ):
        logger.info(event, extra=fields)
        return
    try:
        line = formatter.format_event(time.time(), "INFO", logger.name, event, fields)
    except Exception:
        logger.info(event, extra=fields)  # logging reports what it cannot format
        return
    handler.put_line(line)


def _reaches_only(logger: logging.Logger, handler: logging.Handler) -> bool:
    """Whether a record of `logger` goes to `handler` alone, through no filter."""
    current: logging.Logger | None = logger
    while current is not None:
        if current.filters or current.disabled:
            return False
        if current.parent is None or not current.propagate:
            return current.handlers == [handler] and not handler.filters
        if current.handlers:
            return False
        current = current.parent
    return False
