"""A backend's replica that does not serve the backend's model, over real servers.

The orchestrator only ever asks a replica for its backend's model, so a NOT_FOUND
from one is the deployment's fault (a replica started without that model, a
misspelt name in routes.yaml), not the caller's: the call is retried on another
replica, the route's fallback may answer, and the replica is ejected like one
that does not answer. It was answered NOT_FOUND, with neither retry nor fallback,
which told the caller to fix a request that was right."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from classify_common.metrics import RPC_REQUESTS_TOTAL
from orchestrator.metrics import (
    MODEL_FALLBACK_TOTAL,
    OUTLIER_EJECTIONS_TOTAL,
    UPSTREAM_RETRIES_TOTAL,
)
from tests.conftest import STRIKER, StartCapability, StartOrchestrator, metric_sum
from tests.status_details import error_info, refusal


async def test_a_replica_without_the_model_is_passed_over_and_ejected(
    capability: CapabilityServer,
    start_capability: StartCapability,
    orchestrator_with: StartOrchestrator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    static_only = await start_capability(models=("topic-static",))
    lacking = f"127.0.0.1:{static_only.port}"
    server = await orchestrator_with(
        "version: 1\n"
        "outlier_ejection: {consecutive_failures: 2}\n"
        "backends:\n"
        "  minilm:\n"
        "    model: topic-minilm\n"
        f"    targets: ['127.0.0.1:{capability.port}', '{lacking}']\n"
        "routes:\n"
        "  - name: default\n"
        "    backend: minilm\n"
        "    retry: {max_attempts: 2, initial_backoff: 1ms, max_backoff: 2ms}\n"
    )
    with caplog.at_level(logging.ERROR, logger="orchestrator.upstream.errors"):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            # One at a time: each goes to the replicas in turn, so the one without
            # the model is tried until it is ejected.
            answers = [await stub.Classify(pb.ClassifyRequest(text=STRIKER)) for _ in range(6)]
    assert {(a.model.name, a.fallback) for a in answers} == {("topic-minilm", False)}
    ejected = metric_sum(server.registry, OUTLIER_EJECTIONS_TOTAL, backend="minilm", target=lacking)
    # At least once: on a slow machine its ejection (1 s) can end within the six calls.
    assert ejected >= 1
    causes = [
        getattr(record, "cause", "") for record in caplog.records if record.levelname == "ERROR"
    ]
    assert causes
    assert all("does not serve the backend's model" in cause for cause in causes)


async def test_a_misspelt_model_falls_back_and_without_a_fallback_is_unavailable(
    capability: CapabilityServer, orchestrator_with: StartOrchestrator
) -> None:
    target = f"127.0.0.1:{capability.port}"
    server = await orchestrator_with(
        "version: 1\n"
        "backends:\n"
        f"  misspelt: {{model: topic-minlm, targets: ['{target}']}}\n"
        f"  static: {{model: topic-static, targets: ['{target}']}}\n"
        "routes:\n"
        "  - name: alone\n"
        "    match: {header: {name: x-route, values: [alone]}}\n"
        "    backend: misspelt\n"
        "    retry: {max_attempts: 1}\n"
        "  - name: default\n"
        "    backend: misspelt\n"
        "    fallback: [static]\n"
        "    retry: {max_attempts: 1}\n"
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        answered, refused = await asyncio.gather(
            stub.Classify(pb.ClassifyRequest(text=STRIKER)),
            refusal(
                stub.Classify(pb.ClassifyRequest(text=STRIKER), metadata=(("x-route", "alone"),))
            ),
        )
    assert (answered.model.name, answered.fallback) == ("topic-static", True)
    fallbacks = {"route": "default", "from": "misspelt", "to": "static"}
    assert metric_sum(server.registry, MODEL_FALLBACK_TOTAL, **fallbacks) == 1
    assert (
        metric_sum(server.registry, MODEL_FALLBACK_TOTAL, **fallbacks, reason="MODEL_NOT_SERVED")
        == 1
    )
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    info = error_info(refused)
    assert (info.reason, info.metadata["backend"]) == ("MODEL_NOT_SERVED", "misspelt")
    assert info.metadata["x-request-id"]
    assert info.metadata["x-trace-id"]


async def test_a_lone_replica_without_the_model_is_not_asked_again(
    start_capability: StartCapability, orchestrator_with: StartOrchestrator
) -> None:
    """A replica that does not serve the model answers the same every time: with no
    other replica to try, the call goes on at once (here, to the caller: UNAVAILABLE,
    MODEL_NOT_SERVED) after one attempt, not after three to the same replica."""
    static_only = await start_capability(models=("topic-static",))
    server = await orchestrator_with(
        "version: 1\n"
        "backends:\n"
        f"  minilm: {{model: topic-minilm, targets: ['127.0.0.1:{static_only.port}']}}\n"
        "routes:\n"
        "  - name: default\n"
        "    backend: minilm\n"
        "    retry: {max_attempts: 3, initial_backoff: 1ms, max_backoff: 2ms}\n"
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        refused = await refusal(stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=10))
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(refused).reason == "MODEL_NOT_SERVED"
    assert metric_sum(server.registry, UPSTREAM_RETRIES_TOTAL, backend="minilm") == 0
    asked = metric_sum(
        static_only.registry,
        RPC_REQUESTS_TOTAL,
        method="/ai.classify.v1.ClassifyService/Classify",
    )
    assert asked == 1
