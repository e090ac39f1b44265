"""An error or an answer ready after the caller's deadline passed, over a real
orchestrator: nothing is sent (the caller's own gRPC has answered it
DEADLINE_EXCEEDED), the call counts and logs as DEADLINE_EXCEEDED with a reason, and
gRPC logs no failed send. Under overload the front door refuses calls taken in with
their last milliseconds; a send that failed there was logged as an error with a
traceback."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import grpc
import pytest

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.metrics import CLASSIFY_METHOD
from classify_common import interceptor
from classify_common.errors import Overloaded
from classify_common.metrics import RPC_REQUESTS_TOTAL
from orchestrator.server import OrchestratorServer
from tests.conftest import STRIKER, LineCollector, metric_sum, wait_until
from tests.status_details import refusal

REQUEST_ID = "late-refusal-1"


async def refuse_after_the_deadline(*args: object, **kwargs: object) -> Any:
    # Blocks the event loop past the caller's deadline, as a busy loop does: the
    # call's end has not been read yet when the refusal is decided.
    time.sleep(0.3)  # noqa: ASYNC251 - the blocked loop is the point
    raise Overloaded("planted refusal", retry_after_seconds=1.0)


async def answer_after_the_deadline(*args: object, **kwargs: object) -> Any:
    time.sleep(0.3)  # noqa: ASYNC251 - as above
    return pb.ClassifyResponse(request_id=REQUEST_ID, status=pb.RESULT_STATUS_DONE)


@pytest.mark.parametrize(
    ("planted", "reason"),
    [(refuse_after_the_deadline, "OVERLOADED"), (answer_after_the_deadline, "DEADLINE_EXPIRED")],
)
async def test_what_is_ready_after_the_deadline_is_not_sent_and_counts_as_deadline_exceeded(
    planted: Any,
    reason: str,
    orchestrator: OrchestratorServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    interceptor_log: LineCollector,
) -> None:
    monkeypatch.setattr(orchestrator.dispatcher, "classify", planted)

    def calls(code: str) -> float:
        return metric_sum(
            orchestrator.registry, RPC_REQUESTS_TOTAL, method=CLASSIFY_METHOD, code=code
        )

    before = {code: calls(code) for code in ("DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "OK")}
    caplog.set_level(logging.INFO, logger=interceptor.__name__)  # the "rpc" lines
    with caplog.at_level(logging.ERROR, logger="grpc"):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            # Connected first: the call's 0.1 s are for reaching the handler, and a
            # connection made on a loaded machine could take them all.
            await asyncio.wait_for(channel.channel_ready(), timeout=10)
            error = await refusal(
                stub.Classify(pb.ClassifyRequest(text=STRIKER, request_id=REQUEST_ID), timeout=0.1)
            )
        await wait_until(
            lambda: calls("DEADLINE_EXCEEDED") != before["DEADLINE_EXCEEDED"],
            "the call counted",
            limit_seconds=5,
        )

    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert calls("DEADLINE_EXCEEDED") - before["DEADLINE_EXCEEDED"] == 1
    assert calls("RESOURCE_EXHAUSTED") == before["RESOURCE_EXHAUSTED"]
    assert calls("OK") == before["OK"]
    assert [
        record.getMessage() for record in caplog.records if record.name.startswith("grpc")
    ] == []
    (line,) = [
        entry
        for entry in map(json.loads, interceptor_log.lines)
        if entry.get("request_id") == REQUEST_ID
    ]
    assert (line["code"], line["reason"]) == ("DEADLINE_EXCEEDED", reason)
