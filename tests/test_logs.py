"""Structured logs: JSON lines with request and trace IDs, never blocking the caller."""

from __future__ import annotations

import json
import logging
import queue
from typing import Any

from classify_common.context import RequestContext, bind_request
from classify_common.logs import DroppingQueueHandler, JsonFormatter


def make_handler(capacity: int) -> tuple[DroppingQueueHandler, queue.Queue[Any]]:
    records: queue.Queue[Any] = queue.Queue(capacity)
    handler = DroppingQueueHandler(records)
    handler.setFormatter(JsonFormatter("test"))
    return handler, records


def test_record_is_one_json_line_with_request_and_trace_ids_and_extra_fields() -> None:
    handler, records = make_handler(10)
    logger = logging.getLogger("test.logs.ids")
    logger.addHandler(handler)
    logger.propagate = False
    bind_request(RequestContext(request_id="req-7", trace_id="ab" * 16))
    logger.warning("model ready", extra={"model": "topic-minilm"})
    entry = json.loads(records.get_nowait().getMessage())
    assert entry["event"] == "model ready"
    assert entry["level"] == "warning"
    assert entry["service"] == "test"
    assert (entry["request_id"], entry["trace_id"]) == ("req-7", "ab" * 16)
    assert entry["model"] == "topic-minilm"


def test_full_log_queue_drops_and_counts_instead_of_blocking() -> None:
    handler, records = make_handler(3)
    logger = logging.getLogger("test.logs.full")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    # No writer drains the queue, as when stderr is a pipe nobody reads.
    for n in range(10):
        logger.info("line %d", n)
    assert records.qsize() == 3
    assert handler.dropped == 7
