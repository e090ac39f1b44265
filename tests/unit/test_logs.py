"""Structured logs: JSON lines with request and trace IDs, never blocking the caller."""

from __future__ import annotations

import io
import json
import logging

import pytest
from prometheus_client import CollectorRegistry

from classify_common import logs
from classify_common.context import RequestContext, bind_request
from classify_common.logs import (
    LOG_LINES_DROPPED_TOTAL,
    BatchingLineWriter,
    DroppingQueueHandler,
    JsonFormatter,
    LineQueue,
    LogDrops,
    log_event,
)


def make_handler(capacity: int) -> tuple[DroppingQueueHandler, LineQueue]:
    records = LineQueue(capacity)
    handler = DroppingQueueHandler(records)
    handler.setFormatter(JsonFormatter("test"))
    return handler, records


def logger_into(name: str, handler: logging.Handler) -> logging.Logger:
    """A logger at INFO whose records go to `handler` only."""
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


def test_record_is_one_json_line_with_request_and_trace_ids_and_extra_fields() -> None:
    handler, records = make_handler(10)
    logger = logger_into("test.logs.ids", handler)
    bind_request(RequestContext(request_id="req-7", trace_id="ab" * 16))
    logger.warning("model ready", extra={"model": "topic-minilm"})
    (line,) = records.take_all()
    entry = json.loads(line)
    assert entry["event"] == "model ready"
    assert entry["level"] == "warning"
    assert entry["service"] == "test"
    assert (entry["request_id"], entry["trace_id"]) == ("req-7", "ab" * 16)
    assert entry["model"] == "topic-minilm"


def test_full_log_queue_drops_and_counts_instead_of_blocking() -> None:
    handler, records = make_handler(3)
    logger = logger_into("test.logs.full", handler)
    # No writer drains the queue, as when stderr is a pipe nobody reads.
    for n in range(10):
        logger.info("line %d", n)
    assert [json.loads(line)["event"] for line in records.take_all()] == [
        f"line {n}" for n in range(3)
    ]
    assert handler.dropped == 7
    # ... and the count is a counter on the server's /metrics.
    registry = CollectorRegistry()
    registry.register(LogDrops(lambda: handler))
    assert registry.get_sample_value(LOG_LINES_DROPPED_TOTAL) == 7


def test_writer_writes_every_queued_line_in_order_and_the_rest_when_stopped() -> None:
    handler, records = make_handler(100)
    logger = logger_into("test.logs.writer", handler)
    stream = io.StringIO()
    # An interval no test waits for: only stop() can have written the lines.
    writer = BatchingLineWriter(records, stream, interval=3600)
    writer.start()
    for n in range(5):
        logger.info("line %d", n)
    assert stream.getvalue() == ""

    writer.stop()

    events = [json.loads(line)["event"] for line in stream.getvalue().splitlines()]
    assert events == [f"line {n}" for n in range(5)]
    assert len(records) == 0


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def configured(monkeypatch: pytest.MonkeyPatch) -> LineQueue:
    """The root logger set up as configure_logging does, without its writer thread."""
    handler, records = make_handler(10)
    monkeypatch.setattr(logs, "_handler", handler)
    monkeypatch.setattr(logs, "_formatter", handler.formatter)
    monkeypatch.setattr(logging.root, "handlers", [handler])
    return records


def test_event_line_is_the_line_logging_writes_for_the_same_fields(
    configured: LineQueue,
) -> None:
    logger = logging.getLogger("test.logs.event")
    logger.setLevel(logging.INFO)
    bind_request(RequestContext(request_id="req-8", trace_id="cd" * 16))
    fields = {"method": "/m", "code": "OK", "timings_ms": {"grpc_receive": 0.012}, "n": None}

    log_event(logger, "rpc", fields)
    logger.info("rpc", extra=fields)

    direct, through_logging = (json.loads(line) for line in configured.take_all())
    assert direct.pop("ts")[:19] == through_logging.pop("ts")[:19]
    assert direct == through_logging
    assert list(direct) == list(through_logging)  # the same fields in the same order


def test_event_reaches_a_handler_someone_else_added(configured: LineQueue) -> None:
    logger = logging.getLogger("test.logs.listened")
    logger.setLevel(logging.INFO)
    listener = ListHandler()
    logger.addHandler(listener)
    try:
        log_event(logger, "rpc", {"code": "OK"})
    finally:
        logger.removeHandler(listener)

    heard = [(r.getMessage(), getattr(r, "code", None)) for r in listener.records]
    assert heard == [("rpc", "OK")]
    (line,) = configured.take_all()
    assert json.loads(line)["code"] == "OK"


def test_event_below_the_loggers_level_is_not_written(configured: LineQueue) -> None:
    logger = logging.getLogger("test.logs.quiet")
    logger.setLevel(logging.WARNING)
    log_event(logger, "rpc", {"code": "OK"})
    assert len(configured) == 0


def test_timestamp_is_utc_with_milliseconds_also_when_the_second_changes() -> None:
    formatter = JsonFormatter("test")
    stamps = [
        json.loads(formatter.format_event(created, "INFO", "test", "tick", {}))["ts"]
        for created in (1_700_000_000.5, 1_700_000_000.999, 1_700_000_001.0, 1_699_999_999.25)
    ]
    assert stamps == [
        "2023-11-14T22:13:20.500Z",
        "2023-11-14T22:13:20.999Z",
        "2023-11-14T22:13:21.000Z",
        "2023-11-14T22:13:19.250Z",
    ]
