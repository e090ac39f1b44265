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
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import queue
import sys
import threading
import time
from typing import Any, TextIO

from classify_common.context import current_request

# Lines waiting for the writer thread before new ones are dropped.
LOG_QUEUE_CAPACITY = 10_000
# How often the writer thread writes what is queued; the most a line waits.
LOG_FLUSH_SECONDS = 0.05

# Attributes every LogRecord has; anything else passed via `extra=` is a field.
_STANDARD_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None)))


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self._service,
            "logger": record.name,
            "event": record.getMessage(),
        }
        request = current_request()
        if request is not None:
            entry["request_id"] = request.request_id
            entry["trace_id"] = request.trace_id
        entry.update(
            (key, value)
            for key, value in vars(record).items()
            if key not in _STANDARD_RECORD_ATTRS and not key.startswith("_")
        )
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class DroppingQueueHandler(logging.Handler):
    """Formats on the caller's thread, queues the line without waiting, counts what it drops."""

    def __init__(self, lines: queue.Queue[str]) -> None:
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
        try:
            self.queue.put_nowait(line)
        except queue.Full:
            with self._lock:
                self.dropped += 1


class BatchingLineWriter:
    """A thread that writes queued lines to `stream` every `interval` seconds, all at once."""

    def __init__(self, lines: queue.Queue[str], stream: TextIO, interval: float) -> None:
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
        lines = []
        with contextlib.suppress(queue.Empty):
            while True:
                lines.append(self._lines.get_nowait())
        if not lines:
            return
        # A closed or broken stderr must not end the thread: the lines are lost
        # either way, and the next interval may find it writable again.
        with contextlib.suppress(OSError, ValueError):
            self._stream.write("\n".join(lines) + "\n")
            self._stream.flush()


_writer: BatchingLineWriter | None = None


def configure_logging(service: str, level: str = "INFO") -> DroppingQueueHandler:
    """JSON lines to stderr for the whole process, written off the caller's thread.

    Servers call this once in main; it returns the handler so the drop count can
    be exported.
    """
    global _writer
    if _writer is not None:
        _writer.stop()
    lines: queue.Queue[str] = queue.Queue(LOG_QUEUE_CAPACITY)
    handler = DroppingQueueHandler(lines)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    _writer = BatchingLineWriter(lines, sys.stderr, LOG_FLUSH_SECONDS)
    _writer.start()
    # Write what is queued when the process exits normally.
    atexit.register(_writer.stop)
    return handler
