"""Reflection needs no credentials, so its long-lived streams are bounded, as health's
Watch streams are (tests/unit/test_health_watches.py)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import classify_common.serving
from tests.conftest import StartCapability, wait_until
from tests.status_details import refusal

REFUSAL_WAIT = 5.0  # seconds; a refusal comes at once
LIST_SERVICES = reflection_pb2.ServerReflectionRequest(list_services="")
SERVICES = {
    "ai.classify.v1.ClassifyService",
    "ai.classify.v1.ModelService",
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
}


async def listed(stream: Any) -> set[str]:
    """The services a reflection stream lists when asked once more."""
    await stream.write(LIST_SERVICES)
    answer = await stream.read()
    return {service.name for service in answer.list_services_response.service}


@pytest.mark.parametrize(
    ("max_streams", "per_address", "refused_details"),
    [
        (2, 10, "2 reflection streams are open on this server; try again later"),
        (10, 2, "2 reflection streams are open from ipv4:127.0.0.1; try again later"),
    ],
)
async def test_a_reflection_stream_past_the_bound_is_refused_and_a_closed_one_frees_its_place(
    start_capability: StartCapability,
    monkeypatch: pytest.MonkeyPatch,
    max_streams: int,
    per_address: int,
    refused_details: str,
) -> None:
    """A caller with no key opened ServerReflectionInfo streams, asked once on each and
    kept them open: about 25 KB each, never refused (10,384 took an orchestrator up by
    256 MB). v1 and v1alpha count together: one servicer answers both."""
    monkeypatch.setattr(classify_common.serving, "MAX_REFLECTION_STREAMS", max_streams)
    monkeypatch.setattr(classify_common.serving, "REFLECTION_STREAMS_PER_ADDRESS", per_address)
    server = await start_capability(models=("topic-static",))
    bound = server.serving.reflection.streams
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        # typeshed types the stub for a sync channel; it is built the same on an aio one.
        any_channel: Any = channel
        reflection: Any = reflection_pb2_grpc.ServerReflectionStub(any_channel)
        reflection_v1 = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        streams = [reflection.ServerReflectionInfo(), reflection_v1()]
        for stream in streams:
            assert await listed(stream) == SERVICES
        assert bound.open == 2

        # Unbounded, such a stream waits for its request: DEADLINE_EXCEEDED here.
        refused = await refusal(reflection.ServerReflectionInfo(timeout=REFUSAL_WAIT).read())
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.details() == refused_details
        refused_v1 = await refusal(reflection_v1(timeout=REFUSAL_WAIT).read())
        assert refused_v1.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The streams already open still answer.
        for stream in streams:
            assert await listed(stream) == SERVICES

        # A caller that goes (cancels) frees its place, and so does one that finishes.
        streams[0].cancel()
        await wait_until(lambda: bound.open == 1, "the cancelled stream closed")
        again = reflection.ServerReflectionInfo()
        assert await listed(again) == SERVICES
        await again.done_writing()
        assert await again.code() == grpc.StatusCode.OK
        await wait_until(lambda: bound.open == 1, "the finished stream closed")
        streams[1].cancel()
        await wait_until(lambda: bound.open == 0, "every stream closed")
