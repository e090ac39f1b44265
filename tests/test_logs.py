"""Structured logs: JSON lines with request and trace IDs, never blocking the caller."""

from __future__ import annotations

import io
import json
import logging
import queue

from classify_common.context import RequestContext, bind_request
from classify_common.logs import BatchingLineWriter, DroppingQueueHandler, JsonFormatter


def make_handler(capacity: int) -> tuple[DroppingQueueHandler, queue.Queue[str]]:
    records: queue.Queue[str] = queue.Queue(capacity)
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
    entry = json.loads(records.get_nowait())
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
    assert records.qsize() == 3
    assert handler.dropped == 7


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
    assert records.empty()
