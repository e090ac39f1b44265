"""A call to a method neither server has, over real servers: UNIMPLEMENTED as gRPC
answers it, with the request and trace IDs every other failure carries (gRPC's own
answer had neither), counted under one method name whatever the caller asked for."""

from __future__ import annotations

import json
import logging

import grpc
import pytest

from capability.server import CapabilityServer
from classify_common import interceptor
from classify_common.interceptor import MAX_METHOD_NAME_SHOWN, UNKNOWN_METHOD
from classify_common.metrics import RPC_REQUESTS_TOTAL
from orchestrator.server import OrchestratorServer
from tests.conftest import LineCollector, metric_sum
from tests.status_details import error_reason, refusal, trailers_of

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


async def test_an_unknown_method_is_unimplemented_with_the_calls_ids(
    either_server: OrchestratorServer | CapabilityServer,
    interceptor_log: LineCollector,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=interceptor.__name__)  # the "rpc" lines
    target = either_server
    counted_before = metric_sum(target.registry, RPC_REQUESTS_TOTAL, method=UNKNOWN_METHOD)
    newer = "/ai.classify.v1.ClassifyService/ClassifyStream"
    long_name = "/x." + "y" * 300 + "/Z"
    metadata = (("x-request-id", "asks-too-much"), ("traceparent", TRACEPARENT))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{target.port}") as channel:
        unary: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(newer)
        unary_refused = await refusal(unary(b"\x0a\x01x", metadata=metadata, timeout=10))
        # Any kind of call: a stream is answered before it sends a message.
        streams: grpc.aio.StreamStreamMultiCallable[bytes, bytes] = channel.stream_stream(long_name)
        stream = streams(metadata=metadata, timeout=10)
        stream_refused = await refusal(stream.read())

    for refused in (unary_refused, stream_refused):
        assert refused.code() == grpc.StatusCode.UNIMPLEMENTED
        assert error_reason(refused) == "METHOD_NOT_SERVED"  # checks ErrorInfo's IDs too
        assert trailers_of(refused)["x-request-id"] == "asks-too-much"
        assert trailers_of(refused)["x-trace-id"] == TRACE_ID
    assert unary_refused.details() == (
        f"this server has no method {newer!r}: see the services its reflection lists"
    )
    # One series, whatever names callers try.
    counted = metric_sum(target.registry, RPC_REQUESTS_TOTAL, method=UNKNOWN_METHOD)
    assert counted - counted_before == 2
    assert metric_sum(target.registry, RPC_REQUESTS_TOTAL, method=newer) == 0

    entries = [json.loads(line) for line in interceptor_log.lines]
    lines = [e for e in entries if e["event"] == "rpc" and e.get("method") == UNKNOWN_METHOD]
    assert [e["requested_method"] for e in lines[-2:]] == [
        newer,
        long_name[:MAX_METHOD_NAME_SHOWN] + "…",
    ]
    assert {(e["code"], e["request_id"], e["trace_id"]) for e in lines[-2:]} == {
        ("UNIMPLEMENTED", "asks-too-much", TRACE_ID)
    }
