"""The capability server over real gRPC: health around warm-up, ModelService, reloads."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest
from safetensors.torch import load_file, save_file

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc, model_service_pb2_grpc
from ai.classify.v1 import model_service_pb2 as model_pb
from capability.bundle import write_manifest
from capability.config import CapabilitySettings, ModelServingSettings
from capability.metrics import RELOAD_RETRIES_TOTAL, RELOADS_TOTAL
from capability.server import CapabilityServer
from classify_common.settings import SettingsError
from tests.conftest import (
    REPO_ROOT,
    STRIKER,
    StartCapability,
    capability_settings,
    metric_sum,
    wait_until,
)
from tests.status_details import error_reason, refusal, trailers_of, violations_of


async def health_status(channel: grpc.aio.Channel, service: str) -> int:
    # typeshed's HealthStub declares no methods; Check is generated at runtime.
    stub: Any = health_pb2_grpc.HealthStub(channel)
    reply: health_pb2.HealthCheckResponse = await stub.Check(
        health_pb2.HealthCheckRequest(service=service)
    )
    return int(reply.status)


def copy_version(model_root: Path, target_root: Path, model: str, version: str) -> Path:
    """Copy version 1 of `model` from the session root to `target_root/model/version`."""
    destination = target_root / model / version
    shutil.copytree(model_root / model / "1", destination)
    return destination


async def test_health_is_not_serving_until_warm_up_finishes(model_root: Path) -> None:
    server = CapabilityServer(capability_settings(model_root), registry=CollectorRegistry())
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
            error = await refusal(stub.Classify(pb.ClassifyRequest(text=STRIKER)))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert error_reason(error) == "MODEL_NOT_READY"
            assert trailers_of(error)["x-request-id"]

            await server.warm_up()
            for service in ("", "ai.classify.v1.ClassifyService", "ai.classify.v1.ModelService"):
                assert (
                    await health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING
                )
            response = await stub.Classify(pb.ClassifyRequest(text=STRIKER))
            assert response.labels[0].name == "sports"
    finally:
        await server.stop(grace_seconds=0)


async def write_to_fifo(path: Path, text: str, reader: asyncio.Task[None]) -> None:
    """Write `text` to the FIFO at `path` and close it once a reader has it open; give
    up if `reader`, the task whose work opens it, ends first."""
    while not reader.done():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
            await asyncio.sleep(0.01)
            continue
        with os.fdopen(fd, "w") as stream:
            stream.write(text)
        return


def warm_texts_held(tmp_path: Path) -> tuple[Path, Mapping[str, ModelServingSettings]]:
    """topic-static's per-model settings with a warm_texts file that is a FIFO: read
    at the load's start, it holds that load until the test writes it (write_to_fifo).
    The FIFO and the settings."""
    hot = tmp_path / "hot.txt"
    hot.write_text(f"{STRIKER}\n")
    config = tmp_path / "models.yaml"
    config.write_text("topic-static:\n  warm_texts: hot.txt\n")
    per_model = CapabilitySettings(model_config=config).with_model_config().per_model
    hot.unlink()
    os.mkfifo(hot)
    return hot, per_model


async def test_a_call_for_a_model_the_start_still_loads_is_not_ready_not_unknown(
    model_root: Path, tmp_path: Path
) -> None:
    """Once one model is live, a call for another the start has yet to load was NOT_FOUND:
    to an orchestrator, a server that does not serve it at all (a failure counted for
    ejection), while GetModel said LOADING. It is UNAVAILABLE (MODEL_NOT_READY) now."""
    hot, per_model = warm_texts_held(tmp_path)  # holds topic-static's load, the second
    settings = capability_settings(
        model_root, models=("topic-minilm", "topic-static"), per_model=per_model
    )
    server = CapabilityServer(settings, registry=CollectorRegistry())
    await server.start()
    warm_up = asyncio.create_task(server.warm_up())
    try:
        await wait_until(lambda: "topic-minilm" in server.pool.models(), "topic-minilm live")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            request = pb.ClassifyRequest(text=STRIKER, model="topic-static")
            loading = await refusal(stub.Classify(request))
            assert loading.code() == grpc.StatusCode.UNAVAILABLE
            assert error_reason(loading) == "MODEL_NOT_READY"
            unknown = await refusal(stub.Classify(pb.ClassifyRequest(text=STRIKER, model="nope")))
            assert unknown.code() == grpc.StatusCode.NOT_FOUND

            await write_to_fifo(hot, f"{STRIKER}\n", warm_up)
            await warm_up
            served = await stub.Classify(request)
        assert served.model.name == "topic-static"
    finally:
        await write_to_fifo(hot, "", warm_up)
        await asyncio.gather(warm_up, return_exceptions=True)
        await server.stop(grace_seconds=0)


async def test_get_model_says_loading_while_the_first_version_loads(
    model_root: Path, tmp_path: Path
) -> None:
    hot, per_model = warm_texts_held(tmp_path)
    settings = capability_settings(model_root, models=("topic-static",), per_model=per_model)
    server = CapabilityServer(settings, registry=CollectorRegistry())
    await server.start()
    warm_up = asyncio.create_task(server.warm_up())
    try:
        await asyncio.sleep(0)  # warm_up begins its load
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            models = model_service_pb2_grpc.ModelServiceStub(channel)
            request = model_pb.GetModelRequest(name="topic-static")
            loading = await models.GetModel(request)
            assert loading.model == model_pb.ModelInfo(
                name="topic-static", state=model_pb.MODEL_STATE_LOADING
            )
            other = await refusal(models.GetModel(model_pb.GetModelRequest(name="topic-minilm")))
            assert other.code() == grpc.StatusCode.NOT_FOUND
            # Not NOT_FOUND ("not served here"), which an orchestrator's fleet reload
            # during a rolling restart took for a server without the model.
            reload = model_pb.ReloadModelRequest(name="topic-static")
            reload_refused = await refusal(models.ReloadModel(reload))
            assert reload_refused.code() == grpc.StatusCode.UNAVAILABLE
            assert error_reason(reload_refused) == "MODEL_NOT_READY"

            await write_to_fifo(hot, f"{STRIKER}\n", warm_up)
            await warm_up
            ready = await models.GetModel(request)
        assert (ready.model.state, ready.model.version) == (model_pb.MODEL_STATE_READY, "1")
    finally:
        await write_to_fifo(hot, "", warm_up)
        await asyncio.gather(warm_up, return_exceptions=True)
        await server.stop(grace_seconds=0)


async def test_every_method_is_served_whether_registered_with_grpc_or_not(
    capability_channel: grpc.aio.Channel,
) -> None:
    """Only Classify and ClassifyBatch are registered with gRPC in advance
    (classify_common.serving.HOT_METHODS); the other methods, reflection's and
    health's included, are served through their services' generic handlers."""
    stub = classify_service_pb2_grpc.ClassifyServiceStub(capability_channel)
    single = await stub.Classify(pb.ClassifyRequest(text=STRIKER))
    batch = await stub.ClassifyBatch(
        pb.ClassifyBatchRequest(items=[pb.ClassifyRequest(text=STRIKER)] * 2)
    )
    assert single.labels[0].name == "sports"
    assert [result.response.labels[0].name for result in batch.results] == ["sports"] * 2

    error = await refusal(stub.GetResult(pb.GetResultRequest(request_id="any")))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED
    assert error_reason(error) == "METHOD_NOT_SERVED"
    models = model_service_pb2_grpc.ModelServiceStub(capability_channel)
    listed = await models.ListModels(model_pb.ListModelsRequest())
    assert "topic-minilm" in {model.name for model in listed.models}
    assert await health_status(capability_channel, "") == health_pb2.HealthCheckResponse.SERVING

    # typeshed types the stub for a sync channel; it is built the same on an aio one.
    channel: Any = capability_channel
    reflection: Any = reflection_pb2_grpc.ServerReflectionStub(channel)
    asked = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="ai.classify.v1.ClassifyService"
        ),
    ]
    answers = [answer async for answer in reflection.ServerReflectionInfo(iter(asked))]
    services = {service.name for service in answers[0].list_services_response.service}
    assert services == {
        "ai.classify.v1.ClassifyService",
        "ai.classify.v1.ModelService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    assert answers[1].file_descriptor_response.file_descriptor_proto
    # Every service listed has its descriptor to give (`buf curl --list-methods` asks
    # for each one's, and failed on one listed without it).
    described = [
        answer
        async for answer in reflection.ServerReflectionInfo(
            iter(
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=name)
                for name in sorted(services)
            )
        )
    ]
    assert all(answer.file_descriptor_response.file_descriptor_proto for answer in described)
    # Reflection's stable v1, which tools that speak only it ask for (the messages are
    # v1alpha's on the wire): it was UNIMPLEMENTED.
    reflection_v1 = capability_channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    answers_v1 = [answer async for answer in reflection_v1(iter(asked))]
    assert answers_v1[0].list_services_response == answers[0].list_services_response
    assert answers_v1[1].file_descriptor_response == answers[1].file_descriptor_response


async def test_capability_answers_with_model_version_and_sorted_labels(
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    response = await capability_stub.Classify(pb.ClassifyRequest(text=STRIKER, top_k=2))
    assert response.labels[0].name == "sports"
    assert len(response.labels) == 2
    assert response.labels[0].score >= response.labels[1].score
    assert response.confidence == response.labels[0].score
    assert (response.model.name, response.model.version) == ("topic-minilm", "1")


async def test_model_hint_selects_the_static_model(
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    response = await capability_stub.Classify(
        pb.ClassifyRequest(text=STRIKER, model="topic-static")
    )
    assert response.model.name == "topic-static"
    assert response.labels[0].name == "sports"


async def test_unknown_model_hint_is_not_found(
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    error = await refusal(
        capability_stub.Classify(pb.ClassifyRequest(text=STRIKER, model="no-such-model"))
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error_reason(error) == "MODEL_NOT_FOUND"


async def test_capability_does_not_serve_get_result(
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    error = await refusal(capability_stub.GetResult(pb.GetResultRequest(request_id="abc")))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_model_service_lists_and_describes_both_models(
    model_stub: model_service_pb2_grpc.ModelServiceAsyncStub,
) -> None:
    listed = await model_stub.ListModels(model_pb.ListModelsRequest())
    assert [m.name for m in listed.models] == ["topic-minilm", "topic-static"]
    described = await model_stub.GetModel(model_pb.GetModelRequest(name="topic-minilm"))
    info = described.model
    assert info == listed.models[0]
    assert info.state == model_pb.MODEL_STATE_READY
    assert info.version == "1"
    assert [label.name for label in info.labels] == ["world", "sports", "business", "sci_tech"]
    assert all(label.description for label in info.labels)
    assert info.max_sequence_length == 256
    assert list(info.devices) == ["cpu:0"]
    assert info.precision == "fp32"
    assert info.architecture == "bert-encoder"
    assert len(info.digest) == 64
    assert info.memory_bytes > 20_000_000  # ~22.7 M parameters in fp32
    assert info.load_duration.ToNanoseconds() > 0
    static = listed.models[1]
    assert static.architecture == "static-embedding"
    assert static.memory_bytes < info.memory_bytes


async def test_model_service_answers_not_found_for_unknown_model(
    model_stub: model_service_pb2_grpc.ModelServiceAsyncStub,
) -> None:
    error = await refusal(model_stub.GetModel(model_pb.GetModelRequest(name="no-such-model")))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error_reason(error) == "MODEL_NOT_FOUND"


@pytest.mark.parametrize("version", ["..", "../topic-static", "1/../../x", ".hidden"])
async def test_reload_version_cannot_leave_the_model_root(
    model_stub: model_service_pb2_grpc.ModelServiceAsyncStub, version: str
) -> None:
    error = await refusal(
        model_stub.ReloadModel(model_pb.ReloadModelRequest(name="topic-minilm", version=version))
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations_of(error) == [("version", "string.pattern")]


def flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "named_file"),
    [
        pytest.param(
            lambda d: flip_one_byte(d / "layer_03.safetensors"),
            "layer_03.safetensors",
            id="hash-mismatch",
        ),
        pytest.param(
            lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json", id="missing-file"
        ),
    ],
)
async def test_damaged_bundle_is_refused_naming_the_file_and_old_version_keeps_serving(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    damage: Callable[[Path], None],
    named_file: str,
) -> None:
    root = tmp_path / "models"
    copy_version(model_root, root, "topic-minilm", "1")
    server = await start_capability(model_root=root, models=("topic-minilm",))
    damage(copy_version(model_root, root, "topic-minilm", "2"))

    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        classify = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        error = await refusal(
            models.ReloadModel(model_pb.ReloadModelRequest(name="topic-minilm", version="2"))
        )
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert named_file in (error.details() or "")
        assert "version 1 keeps serving" in (error.details() or "")

        response = await classify.Classify(pb.ClassifyRequest(text=STRIKER))
        assert response.model.version == "1"
        assert response.labels[0].name == "sports"


async def test_reload_switches_versions_and_reports_the_previous_one(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    root = tmp_path / "models"
    copy_version(model_root, root, "topic-minilm", "1")
    server = await start_capability(model_root=root, models=("topic-minilm",))
    copy_version(model_root, root, "topic-minilm", "2")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        reloaded = await models.ReloadModel(model_pb.ReloadModelRequest(name="topic-minilm"))
        assert (reloaded.model.version, reloaded.previous_version) == ("2", "1")
        response = await classify_service_pb2_grpc.ClassifyServiceStub(channel).Classify(
            pb.ClassifyRequest(text=STRIKER)
        )
        assert response.model.version == "2"


async def test_version_refused_half_copied_is_loaded_by_the_watcher_once_its_copy_completes(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    root = tmp_path / "models"
    copy_version(model_root, root, "topic-static", "1")
    server = await start_capability(model_root=root, models=("topic-static",), watch_seconds=0.1)

    def reloads(outcome: str) -> float:
        return metric_sum(server.registry, RELOADS_TOTAL, model="topic-static", outcome=outcome)

    def retries() -> float:
        return metric_sum(server.registry, RELOAD_RETRIES_TOTAL, model="topic-static")

    # The copy broke off halfway through the weights, after the manifest was in.
    staging = copy_version(model_root, tmp_path / "staging", "topic-static", "2")
    whole = (staging / "embeddings.safetensors").read_bytes()
    (staging / "embeddings.safetensors").write_bytes(whole[: len(whole) // 2])
    staging.rename(root / "topic-static" / "2")
    await wait_until(lambda: reloads("refused") == 1)
    await asyncio.sleep(0.5)  # five polls of the unchanged folder try nothing
    assert (reloads("refused"), retries()) == (1, 0)

    # The copy is finished: the whole file takes the partial one's place at once.
    finished = tmp_path / "embeddings.safetensors"
    finished.write_bytes(whole)
    os.replace(finished, root / "topic-static" / "2" / "embeddings.safetensors")

    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)

        async def serving_version_2() -> bool:
            described = await models.GetModel(model_pb.GetModelRequest(name="topic-static"))
            return str(described.model.version) == "2"

        await wait_until(serving_version_2, "version 2 loaded")
        response = await classify_service_pb2_grpc.ClassifyServiceStub(channel).Classify(
            pb.ClassifyRequest(text=STRIKER, model="topic-static")
        )
    assert response.model.version == "2"
    assert response.labels[0].name == "sports"
    assert (reloads("refused"), reloads("ok"), retries()) == (1, 1, 1)


@pytest.mark.parametrize(
    "files", [(), ("config.json", "tokenizer.json")], ids=["empty", "unlisted"]
)
async def test_a_version_folder_without_a_manifest_is_refused_naming_it(
    model_root: Path, tmp_path: Path, start_capability: StartCapability, files: tuple[str, ...]
) -> None:
    root = tmp_path / "models"
    copy_version(model_root, root, "topic-static", "1")
    server = await start_capability(model_root=root, models=("topic-static",))
    folder = root / "topic-static" / "next"
    folder.mkdir()
    for name in files:
        shutil.copy(model_root / "topic-static" / "1" / name, folder)

    error = await reload_refusal(server, "topic-static", "next")
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details() == (
        "version next of 'topic-static' refused, version 1 keeps serving: "
        f"manifest.json: not found in {folder.resolve()}"
    )
    assert metric_sum(server.registry, RELOADS_TOTAL, outcome="refused") == 1
    # A version with no folder at all is not found.
    absent = await reload_refusal(server, "topic-static", "absent")
    assert absent.code() == grpc.StatusCode.NOT_FOUND


class _MakesDirectoryWhenUnpickled:
    """Unpickling this calls os.mkdir(marker): a harmless stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[[str], None], tuple[str]]:
        return (os.mkdir, (str(self.marker),))


async def reload_refusal(
    server: CapabilityServer, model: str, version: str
) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        error = await refusal(
            models.ReloadModel(model_pb.ReloadModelRequest(name=model, version=version))
        )
        response = await classify_service_pb2_grpc.ClassifyServiceStub(channel).Classify(
            pb.ClassifyRequest(text=STRIKER, model=model)
        )
        assert response.model.version == "1", "the old version must keep serving"
    return error


async def test_pickled_code_in_a_new_version_is_refused_and_never_runs(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    root = tmp_path / "models"
    copy_version(model_root, root, "topic-static", "1")
    server = await start_capability(model_root=root, models=("topic-static",))
    bundle = copy_version(model_root, root, "topic-static", "2")
    marker = tmp_path / "payload-ran"
    (bundle / "head.safetensors").unlink()
    torch.save({"prototypes": _MakesDirectoryWhenUnpickled(marker)}, bundle / "head.pt")
    write_manifest(bundle)  # true hashes: the refusal must come from the unpickler

    error = await reload_refusal(server, "topic-static", "2")

    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "head.pt" in (error.details() or "")
    assert not marker.exists()


async def test_version_with_non_finite_weights_is_refused_naming_file_and_tensor(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    root = tmp_path / "models"
    copy_version(model_root, root, "topic-static", "1")
    server = await start_capability(model_root=root, models=("topic-static",))
    bundle = copy_version(model_root, root, "topic-static", "2")
    head = load_file(bundle / "head.safetensors")
    save_file(
        {name: torch.full_like(t, float("nan")) for name, t in head.items()},
        bundle / "head.safetensors",
    )
    write_manifest(bundle)

    error = await reload_refusal(server, "topic-static", "2")

    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "head.safetensors: tensor prototypes holds non-finite values" in (error.details() or "")


async def test_metrics_scrape_reports_queue_model_and_process_memory_series_on_cpu(
    capability: CapabilityServer,
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    await capability_stub.Classify(pb.ClassifyRequest(text=STRIKER))
    exposition = generate_latest(capability.registry).decode()
    assert (
        'classify_model_info{model="topic-minilm",precision="fp32",version="1",worker="cpu:0"} 1.0'
        in exposition
    )
    assert 'classify_queue_depth{model="topic-minilm",worker="cpu:0"}' in exposition
    # A CPU worker's memory is the process's; glibc reports no fragmentation.
    for kind in ("allocated", "reserved", "peak", "total"):
        assert f'classify_device_memory_bytes{{kind="{kind}",worker="cpu:0"}}' in exposition
    assert "classify_device_fragmentation_bytes{" not in exposition
    assert "classify_device_utilisation{" not in exposition
    # The process's own CPU and memory, as the runbook reads them.
    assert re.search(r"^process_cpu_seconds_total \d", exposition, re.M)
    assert re.search(r"^process_resident_memory_bytes \d", exposition, re.M)


MISSPELT_CONFIG = "topic-static:\n  max_batch_size: 8\ntopic-minlm:\n  residency: on_demand\n"


@pytest.mark.parametrize(
    ("entry", "refusal"),
    [
        (
            "  queue_capacity: 8\n  max_batch_size: 5000\n",
            ":3: topic-static.max_batch_size: max_batch_size 5000 is outside 1..1024",
        ),
        # In the file's unit and key, not max_wait_seconds 5.0 (no such key in it).
        (
            "  max_wait_ms: 5000\n",
            ":2: topic-static.max_wait_ms: max_wait_ms 5000 is outside 0..1000",
        ),
        # As written: :g printed it "1000", inside the bounds it named.
        (
            "  max_wait_ms: 1000.0000001\n",
            ":2: topic-static.max_wait_ms: max_wait_ms 1000.0000001 is outside 0..1000",
        ),
        (
            "  max_wait_ms: -0.0000001\n",
            ":2: topic-static.max_wait_ms: max_wait_ms -0.0000001 is outside 0..1000",
        ),
        (
            "  queue_capacity: 8\n  length_buckets: [64, 32]\n",
            ":3: topic-static.length_buckets: length_buckets (64, 32) must be ascending positive "
            "integers",
        ),
        # The other settings too (they were put at the model's line).
        (
            "  max_batch_size: 8\n  residency: ondemand\n",
            ":3: topic-static.residency: residency 'ondemand' is not one of",
        ),
        (
            "  max_batch_size: 8\n  cache_hit_floor: 1.5\n",
            ":3: topic-static.cache_hit_floor: cache_hit_floor 1.5 is outside 0..1",
        ),
        (
            "  max_batch_size: 8\n  warm_texts: [hot.txt]\n",
            ":3: topic-static.warm_texts: ['hot.txt'] is not a file name",
        ),
    ],
)
def test_a_batching_value_out_of_range_is_refused_at_its_own_line_and_key(
    tmp_path: Path, entry: str, refusal: str
) -> None:
    """It was put at the model's line (1), naming neither key nor file's unit."""
    config = tmp_path / "models.yaml"
    config.write_text("topic-static:\n" + entry)
    with pytest.raises(SettingsError) as refused:
        CapabilitySettings(model_config=config).with_model_config()
    assert str(refused.value).startswith(
        f"--model-config / CAPABILITY_MODEL_CONFIG: {config}{refusal}"
    )


async def test_a_model_config_entry_for_a_model_not_served_stops_the_start(
    start_capability: StartCapability, tmp_path: Path
) -> None:
    config = tmp_path / "models.yaml"
    config.write_text(MISSPELT_CONFIG)
    per_model = CapabilitySettings(model_config=config).with_model_config().per_model
    with pytest.raises(SettingsError) as refused:
        await start_capability(model_config=config, per_model=per_model)
    assert str(refused.value) == (
        f"--model-config / CAPABILITY_MODEL_CONFIG: {config}:3: topic-minlm: no model "
        "served here has this name (served: topic-minilm, topic-static)"
    )
    # Served is what --models names, not what lies under the root.
    config.write_text("topic-minilm:\n  max_batch_size: 8\n")
    per_model = CapabilitySettings(model_config=config).with_model_config().per_model
    with pytest.raises(SettingsError, match=r":1: topic-minilm: .*\(served: topic-static\)$"):
        await start_capability(models=("topic-static",), model_config=config, per_model=per_model)


def test_the_server_process_refuses_a_misspelt_model_config_entry_in_one_line(
    model_root: Path, tmp_path: Path
) -> None:
    config = tmp_path / "models.yaml"
    config.write_text(MISSPELT_CONFIG)
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "capability",
            *("--port", "0", "--metrics-port", "-1", "--device", "cpu"),
            *("--model-root", str(model_root), "--model-config", str(config)),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2
    (line,) = [json.loads(text) for text in refused.stderr.splitlines() if "cannot start" in text]
    assert line["error"] == (
        f"--model-config / CAPABILITY_MODEL_CONFIG: {config}:3: topic-minlm: no model "
        "served here has this name (served: topic-minilm, topic-static)"
    )
    assert "Traceback" not in refused.stderr


async def test_a_second_server_on_a_port_in_use_does_not_start(
    capability: CapabilityServer, model_root: Path
) -> None:
    """gRPC's default on Linux (SO_REUSEPORT) would let it share the port, the kernel
    splitting connections between the two servers, without a word."""
    second = CapabilityServer(
        capability_settings(model_root, models=("topic-static",), port=capability.port),
        registry=CollectorRegistry(),
    )
    with pytest.raises(OSError, match=r"cannot listen on .*: the port is in use") as refused:
        await second.start()
    await second.stop(grace_seconds=0)
    assert str(capability.port) in str(refused.value)
