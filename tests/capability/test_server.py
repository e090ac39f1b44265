"""The capability server over real gRPC: health around warm-up, ModelService, reload."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc, model_service_pb2_grpc
from ai.classify.v1 import model_service_pb2 as model_pb
from capability.config import CapabilitySettings, default_model_dir
from capability.server import CapabilityServer
from tests.status_details import error_reason

STRIKER = "The striker scored twice in the final minutes of the cup match"


async def health_status(channel: grpc.aio.Channel, service: str) -> int:
    # typeshed's HealthStub declares no methods; Check is generated at runtime.
    stub: Any = health_pb2_grpc.HealthStub(channel)
    reply: health_pb2.HealthCheckResponse = await stub.Check(
        health_pb2.HealthCheckRequest(service=service)
    )
    return int(reply.status)


async def test_health_is_not_serving_until_warm_up_finishes() -> None:
    server = CapabilityServer(
        CapabilitySettings(port=0, metrics_port=-1, device="cpu"), registry=CollectorRegistry()
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            for service in ("", "ai.classify.v1.ClassifyService"):
                assert (
                    await health_status(channel, service)
                    == health_pb2.HealthCheckResponse.NOT_SERVING
                )

            # A request that arrives anyway is refused as a model error, with IDs.
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Classify(pb.ClassifyRequest(text=STRIKER))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert error_reason(caught.value) == "MODEL_NOT_READY"
            assert dict(caught.value.trailing_metadata() or ())["x-request-id"]

            await server.warm_up()
            for service in ("", "ai.classify.v1.ClassifyService", "ai.classify.v1.ModelService"):
                assert (
                    await health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING
                )
            response = await stub.Classify(pb.ClassifyRequest(text=STRIKER))
            assert response.labels[0].name == "sports"
    finally:
        await server.stop(grace_seconds=0)


async def test_capability_answers_with_model_version_and_sorted_labels(
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
    capability: CapabilityServer,
) -> None:
    response = await capability_stub.Classify(pb.ClassifyRequest(text=STRIKER, top_k=2))
    served = capability.engine.served
    assert served is not None
    assert response.labels[0].name == "sports"
    assert len(response.labels) == 2
    assert response.labels[0].score >= response.labels[1].score
    assert response.confidence == response.labels[0].score
    assert response.model.name == "topic-minilm"
    assert response.model.version == served.version
    assert len(response.model.version) == 12


async def test_capability_does_not_serve_get_result(
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await capability_stub.GetResult(pb.GetResultRequest(request_id="abc"))
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_model_service_lists_and_describes_the_serving_model(
    model_stub: model_service_pb2_grpc.ModelServiceAsyncStub, capability: CapabilityServer
) -> None:
    listed = await model_stub.ListModels(model_pb.ListModelsRequest())
    described = await model_stub.GetModel(model_pb.GetModelRequest(name="topic-minilm"))
    assert [m.name for m in listed.models] == ["topic-minilm"]
    info = described.model
    assert info == listed.models[0]
    assert info.state == model_pb.MODEL_STATE_READY
    assert [label.name for label in info.labels] == ["world", "sports", "business", "sci_tech"]
    assert all(label.description for label in info.labels)
    assert info.max_sequence_length == 256
    assert list(info.devices) == ["cpu"]
    assert info.load_duration.ToNanoseconds() > 0


async def test_model_service_answers_not_found_for_unknown_model(
    model_stub: model_service_pb2_grpc.ModelServiceAsyncStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await model_stub.GetModel(model_pb.GetModelRequest(name="no-such-model"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_reason(caught.value) == "MODEL_NOT_FOUND"


async def test_failed_reload_is_refused_naming_the_file_and_old_version_keeps_serving(
    tmp_path: Path,
) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(default_model_dir(), model_dir)
    server = CapabilityServer(
        CapabilitySettings(port=0, metrics_port=-1, device="cpu", model_dir=model_dir),
        registry=CollectorRegistry(),
    )
    await server.start()
    await server.warm_up()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            models = model_service_pb2_grpc.ModelServiceStub(channel)
            classify = classify_service_pb2_grpc.ClassifyServiceStub(channel)

            reloaded = await models.ReloadModel(model_pb.ReloadModelRequest(name="topic-minilm"))
            version = reloaded.model.version
            assert reloaded.previous_version == version  # same weights, same version

            (model_dir / "tokenizer.json").unlink()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await models.ReloadModel(model_pb.ReloadModelRequest(name="topic-minilm"))
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "tokenizer.json" in (caught.value.details() or "")

            response = await classify.Classify(pb.ClassifyRequest(text=STRIKER))
            assert response.model.version == version
            assert response.labels[0].name == "sports"
    finally:
        await server.stop(grace_seconds=0)
