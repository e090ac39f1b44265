"""Structured logs: one JSON object per line, carrying the request and trace IDs.

Records are formatted on the calling thread (so contextvars such as the request
ID are read where the record was made) and written by a background thread
through a bounded queue. The event loop therefore never blocks on a slow or
full stderr (a pipe nobody reads, a stalled log shipper); when the queue is
full, records are dropped and counted instead.
"""

from __future__ import annotations

import atexit
import json
import logging
import queue
import sys
import threading
import time
from logging.handlers import QueueHandler, QueueListener
from typing import Any

from classify_common.context import current_request

# Records waiting for the writer thread before new ones are dropped.
LOG_QUEUE_CAPACITY = 10_000

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


class DroppingQueueHandler(QueueHandler):
    """Formats on the caller's thread, enqueues without waiting, counts what it drops."""

    def __init__(self, records: queue.Queue[Any]) -> None:
        super().__init__(records)
        self.dropped = 0
        self._lock = threading.Lock()

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        # Freeze the message now: contextvars and mutable args belong to this thread.
        line = self.format(record)
        return logging.makeLogRecord({"msg": line, "levelno": record.levelno})

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            with self._lock:
                self.dropped += 1


class _LineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes the pre-formatted line as it is."""

    def format(self, record: logging.LogRecord) -> str:
        return record.getMessage()


_listener: QueueListener | None = None


def configure_logging(service: str, level: str = "INFO") -> DroppingQueueHandler:
    """JSON lines to stderr for the whole process, written off the caller's thread.

    Servers call this once in main; it returns the handler so the drop count can
    be exported.
    """
    global _listener
    if _listener is not None:
        _listener.stop()
    records: queue.Queue[Any] = queue.Queue(LOG_QUEUE_CAPACITY)
    handler = DroppingQueueHandler(records)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    _listener = QueueListener(records, _LineHandler(sys.stderr))
    _listener.start()
    # Flush what is queued when the process exits normally.
    atexit.register(_listener.stop)
    return handler
