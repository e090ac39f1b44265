"""On-demand residency over real gRPC, on the CPU through the code a GPU takes: the
weights wait in host memory, the first request copies them onto the device (a cold
start, counted and timed), an idle model leaves again and gives its memory back, a
deadline shorter than the cold start is refused so a fallback can answer, twenty
models share a budget that holds five under round-robin load, a load makes room by
evicting idle models and copies none onto the device to refill the result cache, a
cold start that finds no room in time is refused for memory while its caller can
still fall back, and result-cache hits keep no model on the device; and sharding is
refused where it cannot run."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc, model_service_pb2_grpc
from ai.classify.v1 import model_service_pb2 as model_pb
from capability.bundle import BundleConfigInvalid, write_manifest
from capability.config import CapabilitySettings
from capability.metrics import (
    ADMISSIONS_REFUSED_TOTAL,
    DEVICE_CACHE_RELEASES_TOTAL,
    DEVICE_MEMORY_BYTES,
    MODEL_COLD_START_SECONDS,
    MODEL_COLD_STARTS_TOTAL,
    MODEL_EVICTIONS_TOTAL,
    MODEL_FORWARD_TOTAL,
    MODEL_RESIDENT,
    RESULT_CACHE_WARMED_TOTAL,
)
from capability.server import CapabilityServer
from classify_common.errors import ServerDraining
from classify_common.settings import SettingsError
from orchestrator.metrics import MODEL_FALLBACK_TOTAL
from tests.conftest import (
    STRIKER,
    StartCapability,
    StartOrchestrator,
    capability_settings,
    metric_sum,
    wait_until,
)
from tests.status_details import error_info, refusal
from tests.unit.capability.test_model_watcher import deploy, reload_model
from tests.unit.capability.test_serving import device_occupied

MODEL = "topic-static"
ON_CPU = {"model": MODEL, "worker": "cpu:0"}


def counted(server: CapabilityServer, name: str, **labels: str) -> float:
    return metric_sum(server.registry, name, **{"model": MODEL, **labels})


async def on_demand(start_capability: StartCapability, idle_seconds: float) -> CapabilityServer:
    return await start_capability(models=(MODEL,), residency="on_demand", idle_seconds=idle_seconds)


async def resident_now(server: CapabilityServer) -> bool:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = model_service_pb2_grpc.ModelServiceStub(channel)
        info = (await stub.GetModel(model_pb.GetModelRequest(name=MODEL))).model
    assert info.residency == "on_demand"
    (entry,) = info.memory
    return entry.resident


async def classify(server: CapabilityServer) -> pb.ClassifyResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        return await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL))


async def test_an_on_demand_model_waits_in_host_memory_until_a_request_needs_it(
    start_capability: StartCapability,
) -> None:
    server = await on_demand(start_capability, idle_seconds=3600)
    assert not await resident_now(server)
    assert counted(server, MODEL_RESIDENT, worker="cpu:0") == 0

    first = await classify(server)
    assert first.labels[0].name == "sports"
    assert counted(server, MODEL_COLD_STARTS_TOTAL, **ON_CPU) == 1
    assert counted(server, MODEL_COLD_START_SECONDS + "_count") == 1
    assert counted(server, MODEL_COLD_START_SECONDS + "_sum") > 0
    assert await resident_now(server)
    assert counted(server, MODEL_RESIDENT, worker="cpu:0") == 1

    second = await classify(server)
    assert list(second.labels) == list(first.labels)
    assert counted(server, MODEL_COLD_STARTS_TOTAL, **ON_CPU) == 1


async def test_an_idle_on_demand_model_leaves_the_device_and_a_request_brings_it_back(
    start_capability: StartCapability,
) -> None:
    server = await on_demand(start_capability, idle_seconds=0.3)

    def allocated() -> float:
        return metric_sum(server.registry, DEVICE_MEMORY_BYTES, worker="cpu:0", kind="allocated")

    def evicted() -> float:
        return counted(server, MODEL_EVICTIONS_TOTAL, reason="idle", **ON_CPU)

    before = allocated()
    first = await classify(server)
    on_device = allocated()
    await wait_until(lambda: evicted() == 1, "evicted when idle")
    assert not await resident_now(server)
    assert counted(server, MODEL_RESIDENT, worker="cpu:0") == 0
    # After the load, and after this eviction: the release is counted once its
    # collection on the device thread is over, a little after the eviction.
    await wait_until(
        lambda: metric_sum(server.registry, DEVICE_CACHE_RELEASES_TOTAL, reason="evicted") == 2,
        "the cache released after the eviction",
    )
    # The device copy (the weights, 46.9 MB) is gone again: back near the level before.
    weights = 46_887_936
    assert on_device - before > 0.8 * weights
    assert allocated() < on_device - 0.8 * weights

    forwards = counted(server, MODEL_FORWARD_TOTAL)
    again = await classify(server)
    assert list(again.labels) == list(first.labels)
    assert counted(server, MODEL_COLD_STARTS_TOTAL, **ON_CPU) == 2
    assert counted(server, MODEL_FORWARD_TOTAL) == forwards + 1


async def test_a_deadline_shorter_than_the_cold_start_is_refused_before_loading(
    start_capability: StartCapability,
) -> None:
    server = await on_demand(start_capability, idle_seconds=3600)
    # Predicted from the load: reading the weights and tracing the graph (tens of ms
    # or more), while computing one text takes a few ms.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        item = pb.ClassifyRequest(text=STRIKER, model=MODEL)
        context = pb.ItemContext(timeout=duration_pb2.Duration(nanos=2_000_000))
        batch = await stub.ClassifyBatch(
            pb.ClassifyBatchRequest(items=[item], item_contexts=[context])
        )
        error = batch.results[0].error
        assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert "is not on cpu:0: copying it there and computing takes about" in error.message
        # (Its refusal may come from the transport already: only the code is certain.)
        unary = await refusal(stub.Classify(item, timeout=0.002))
        assert unary.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert counted(server, MODEL_COLD_STARTS_TOTAL, **ON_CPU) == 0
    assert not await resident_now(server)


def test_sharding_on_one_device_is_refused_naming_the_flag(model_root: Path) -> None:
    with pytest.raises(SettingsError) as refused:
        CapabilityServer(
            capability_settings(model_root, residency="sharded", cpu_workers=1),
            registry=CollectorRegistry(),
        )
    assert str(refused.value) == (
        "--residency / CAPABILITY_RESIDENCY: sharded splits a model's layers across devices "
        "and needs at least 2; this server has 1 (cpu:0). Use resident or on_demand, or "
        "give --device cuda:0,cuda:1"
    )


async def test_a_sharded_model_scores_as_the_resident_one(
    start_capability: StartCapability, capability: CapabilityServer
) -> None:
    # Two CPU workers stand in for two GPUs: the same moves between devices run.
    sharded = await start_capability(models=("topic-minilm",), residency="sharded", cpu_workers=2)
    first, second = sharded.pool.workers
    replica = first.replicas["topic-minilm"]
    assert [(str(device), list(run)) for device, run in replica.shards] == [
        ("cpu", [0, 1, 2]),
        ("cpu", [3, 4, 5]),
    ]
    assert "topic-minilm" not in second.replicas  # served by the first worker only
    texts = [STRIKER, "Shares fell after the bank cut its forecast", "A new telescope image"]
    items = [pb.ClassifyRequest(text=text) for text in texts]
    answers = {}
    for server in (sharded, capability):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            batch = await stub.ClassifyBatch(pb.ClassifyBatchRequest(items=items))
            answers[server.port] = [
                {label.name: label.score for label in result.response.labels}
                for result in batch.results
            ]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            models = model_service_pb2_grpc.ModelServiceStub(channel)
            info = (await models.GetModel(model_pb.GetModelRequest(name="topic-minilm"))).model
        if server is sharded:
            assert info.residency == "sharded"
            assert list(info.devices) == ["cpu:0", "cpu:1"]
    for got, want in zip(answers[sharded.port], answers[capability.port], strict=True):
        assert got.keys() == want.keys()
        for label, score in want.items():
            assert got[label] == pytest.approx(score, abs=1e-5)


# What topic-static's weights take on a device (its ledger's `weights`).
STATIC_WEIGHT_BYTES = 46_887_936
# Texts whose topic-static answers differ: sports, business, science and technology.
TOPICAL_TEXTS = (
    STRIKER,
    "Shares fell sharply after the bank reported lower quarterly profits",
    "The new processor doubles battery life in laptops and phones",
)


def copy_under_names(bundle: Path, root: Path, names: Sequence[str]) -> None:
    """`bundle` as version 1 of each of `names` under `root`: the weights hard-linked
    (the same bytes, no copying), config.json renamed, and a new manifest."""
    for name in names:
        copy = root / name / "1"
        shutil.copytree(bundle, copy, copy_function=os.link)
        config = json.loads((copy / "config.json").read_text())
        # A new file, not a write through the link into the original bundle.
        (copy / "config.json").unlink()
        (copy / "config.json").write_text(json.dumps({**config, "name": name}))
        write_manifest(copy)


def room_for(server: CapabilityServer, names: Sequence[str], count: int) -> int:
    """Set the budget of `server`'s one worker so that any `count` of `names` fit on
    it together but no `count + 1`, from the footprints measured at its start (each
    version's ledger entry), and return it. On the CPU a footprint is the resident
    set's growth over the load, which varies between machines and with what the
    process did before: the first load in a process read 1.5 times its weights on one
    machine and about its weights on another, so a budget fixed in weights (1.5, 1.9,
    3.2 of them) held more or fewer models there, or refused the first at start. Start
    such a server with the default budget, which holds every version."""
    worker = server.pool.workers[0]
    footprints = []
    for name in names:
        ledger = worker.replicas[name].ledger
        assert ledger is not None
        footprints.append(ledger.footprint_bytes)
    footprints.sort()
    largest = sum(footprints[-count:])  # any `count` fit ...
    smallest = sum(footprints[: count + 1])  # ... and no `count + 1`
    assert largest < smallest, f"no budget holds any {count} but no {count + 1} of {footprints}"
    worker.memory_budget_bytes = (largest + smallest) // 2
    return worker.memory_budget_bytes


async def test_six_models_share_a_budget_that_holds_two_evicting_the_least_recently_used(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    names = [f"static-{index}" for index in range(6)]
    copy_under_names(model_root / MODEL / "1", tmp_path / "models", names)
    server = await start_capability(
        model_root=tmp_path / "models",
        default_model=names[0],
        residency="on_demand",
        idle_seconds=3600,
    )
    room_for(server, names, 2)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        for _ in range(2):
            for name in names:
                answer = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=name))
                assert (answer.model.name, answer.labels[0].name) == (name, "sports")

    def total(metric: str, **labels: str) -> float:
        return metric_sum(server.registry, metric, **labels)

    # Round-robin over more models than fit: each request finds its model evicted.
    assert total(MODEL_COLD_STARTS_TOTAL) == 12
    assert total(MODEL_EVICTIONS_TOTAL, reason="budget") >= 10
    assert total(MODEL_RESIDENT) <= 2
    worker = server.pool.workers[0]
    assert worker.held_bytes() <= worker.memory_budget_bytes


async def test_a_cold_start_waits_for_a_busy_model_to_go_idle_to_take_its_room(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    names = ["static-a", "static-b"]
    copy_under_names(model_root / MODEL / "1", tmp_path / "models", names)
    server = await start_capability(
        model_root=tmp_path / "models",
        default_model=names[0],
        residency="on_demand",
        idle_seconds=3600,
    )
    room_for(server, names, 1)
    worker = server.pool.workers[0]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)

        def classify(name: str) -> Any:
            return asyncio.ensure_future(
                stub.Classify(pb.ClassifyRequest(text=STRIKER, model=name), timeout=30)
            )

        await classify("static-a")  # a is on the device, alone in the budget
        async with device_occupied(worker):
            busy = classify("static-a")  # queued behind the held device: a is busy
            await wait_until(lambda: worker.replicas["static-a"].load == 1)
            cold = classify("static-b")  # needs a's room while a is busy
            await wait_until(
                lambda: worker.replicas["static-b"].load == 1 and worker._residency.locked()
            )
            assert not cold.done()  # waiting for room, not refused
        # Once a's request is answered, a is idle: evicted for b, which then answers.
        answers = await asyncio.gather(busy, cold)
    assert [answer.model.name for answer in answers] == names
    assert [answer.labels[0].name for answer in answers] == ["sports", "sports"]
    assert metric_sum(server.registry, MODEL_EVICTIONS_TOTAL, reason="budget") == 1
    assert metric_sum(server.registry, MODEL_RESIDENT, model="static-b") == 1


async def test_twenty_models_with_a_budget_for_five_all_answer_correctly_under_round_robin_load(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    names = [f"static-{index:02d}" for index in range(20)]
    copy_under_names(model_root / MODEL / "1", tmp_path / "models", names)
    reference = await start_capability(models=(MODEL,))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{reference.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        expected = {
            text: (await stub.Classify(pb.ClassifyRequest(text=text, model=MODEL))).labels
            for text in TOPICAL_TEXTS
        }
    assert len({labels[0].name for labels in expected.values()}) == len(TOPICAL_TEXTS)
    server = await start_capability(
        model_root=tmp_path / "models",
        default_model=names[0],
        residency="on_demand",
        idle_seconds=3600,
    )
    room_for(server, names, 5)

    async def classify_on(stub: Any, name: str, text: str) -> None:
        answer = await stub.Classify(pb.ClassifyRequest(text=text, model=name), timeout=60)
        assert answer.model.name == name
        assert [label.name for label in answer.labels] == [
            label.name for label in expected[text]
        ], (name, text)
        for got, want in zip(answer.labels, expected[text], strict=True):
            assert got.score == pytest.approx(want.score, abs=1e-5), (name, text)

    # Each round sends one text to every model at once, the texts rotating over the
    # models: twenty cold starts compete for five places.
    rounds = 2
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        for turn in range(rounds):
            await asyncio.gather(
                *[
                    classify_on(stub, name, TOPICAL_TEXTS[(index + turn) % len(TOPICAL_TEXTS)])
                    for index, name in enumerate(names)
                ]
            )

    def total(metric: str, **labels: str) -> float:
        return metric_sum(server.registry, metric, **labels)

    cold_starts = total(MODEL_COLD_STARTS_TOTAL)
    resident = total(MODEL_RESIDENT)
    # Every model came onto the device at least once a round but for the five (at
    # most) still there from the round before; each cold start was timed; every
    # model that left was evicted for room (none was idle an hour).
    assert cold_starts >= len(names) + (rounds - 1) * (len(names) - 5)
    assert all(total(MODEL_COLD_STARTS_TOTAL, model=name) >= 1 for name in names)
    assert total(MODEL_COLD_START_SECONDS + "_count") == cold_starts
    assert total(MODEL_EVICTIONS_TOTAL, reason="budget") == cold_starts - resident
    assert total(MODEL_EVICTIONS_TOTAL, reason="idle") == 0
    assert resident <= 5
    worker = server.pool.workers[0]
    assert worker.held_bytes() <= worker.memory_budget_bytes


async def test_a_primary_that_cannot_wait_for_its_cold_start_falls_back(
    start_capability: StartCapability,
    capability: CapabilityServer,
    orchestrator_with: StartOrchestrator,
) -> None:
    cold = await start_capability(
        models=("topic-minilm",), residency="on_demand", idle_seconds=3600
    )
    # The primary's 50 ms are less than the minilm's predicted cold start (its
    # weights copied, six layers traced: its load's own stages); the capability
    # refuses before any work, and the static fallback answers in the call's time.
    front = await orchestrator_with(
        f"""version: 1
backends:
  minilm:
    model: topic-minilm
    targets: ["127.0.0.1:{cold.port}"]
    timeout: 50ms
  static:
    model: topic-static
    targets: ["127.0.0.1:{capability.port}"]
routes:
  - name: default
    backend: minilm
    fallback: [static]
"""
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{front.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        answer = await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=10)
    assert answer.fallback
    assert (answer.model.name, answer.labels[0].name) == ("topic-static", "sports")
    fell_back = metric_sum(
        front.registry, MODEL_FALLBACK_TOTAL, reason="DEADLINE_UNREACHABLE", route="default"
    )
    assert fell_back == 1
    assert metric_sum(cold.registry, MODEL_COLD_STARTS_TOTAL) == 0


async def test_a_model_without_layers_is_not_sharded(start_capability: StartCapability) -> None:
    with pytest.raises(BundleConfigInvalid) as refused:
        await start_capability(models=(MODEL,), residency="sharded", cpu_workers=2)
    assert str(refused.value).startswith(
        "config.json: a static-embedding model has no layers to shard (residency: sharded); "
        f"use resident or on_demand (version 1 of model '{MODEL}', "
    )


async def on_demand_in_room_for_one(
    start_capability: StartCapability,
    model_root: Path,
    tmp_path: Path,
    names: Sequence[str] = ("static-a", "static-b"),
    **settings: Any,
) -> CapabilityServer:
    """`names`, all on_demand (unless `settings` says otherwise), in a budget that
    holds one of them (`room_for`)."""
    copy_under_names(model_root / MODEL / "1", tmp_path / "models", names)
    server = await start_capability(
        model_root=tmp_path / "models",
        default_model=names[0],
        residency="on_demand",
        idle_seconds=3600,
        **settings,
    )
    room_for(server, names, 1)
    return server


async def a_idle_on_the_device_and_b_version_2_on_disk(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> CapabilityServer:
    """static-a and static-b, on_demand in room for one; a called (on the device, idle)
    and a version 2 of b copied in, for a ReloadModel to load."""
    server = await on_demand_in_room_for_one(start_capability, model_root, tmp_path)
    shutil.copytree(tmp_path / "models" / "static-b" / "1", tmp_path / "models" / "static-b" / "2")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        await stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-a"))
    return server


async def test_a_reload_evicts_an_idle_on_demand_model_to_make_room(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    server = await a_idle_on_the_device_and_b_version_2_on_disk(
        start_capability, model_root, tmp_path
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        reloaded = await models.ReloadModel(model_pb.ReloadModelRequest(name="static-b"))
        assert reloaded.model.version == "2"
        # a left the device for b's load, and b then waits in host memory.
        evicted = {"model": "static-a", "reason": "budget"}
        assert metric_sum(server.registry, MODEL_EVICTIONS_TOTAL, **evicted) == 1
        assert metric_sum(server.registry, MODEL_RESIDENT) == 0
        assert metric_sum(server.registry, MODEL_COLD_STARTS_TOTAL, model="static-b") == 0
        for name in ("static-b", "static-a"):
            answer = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=name))
            assert (answer.model.name, answer.labels[0].name) == (name, "sports")
    worker = server.pool.workers[0]
    assert worker.held_bytes() <= worker.memory_budget_bytes


async def test_a_version_replaced_while_a_text_was_on_its_way_is_not_copied_onto_the_device(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    """A text routed to version 1 before a swap reached its cold start after it: version
    1 was copied onto the device for that one text (a cold start counted, room made),
    and `classify_model_resident` stayed 1 after it retired while version 2, serving,
    was not on the device. The text is sent again instead (SERVER_DRAINING, as the
    texts a retiring version leaves are)."""
    root = tmp_path / "models"
    deploy(model_root, root, "1")
    server = await start_capability(
        model_root=root, models=(MODEL,), residency="on_demand", idle_seconds=3600
    )
    worker = server.pool.workers[0]
    replaced = worker.replicas[MODEL]
    deploy(model_root, root, "2")
    assert (await reload_model(server)).model.version == "2"

    with pytest.raises(ServerDraining, match="the model version was replaced"):
        await worker.ensure_resident(replaced)

    assert not replaced.is_resident
    assert counted(server, MODEL_COLD_STARTS_TOTAL, **ON_CPU) == 0
    assert counted(server, MODEL_RESIDENT, worker="cpu:0") == 0
    assert (await classify(server)).model.version == "2"


async def test_a_load_that_cannot_fit_even_with_every_on_demand_model_off_evicts_none(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    server = await a_idle_on_the_device_and_b_version_2_on_disk(
        start_capability, model_root, tmp_path
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        # A budget smaller than the new version alone: no eviction can make its room.
        server.pool.workers[0].memory_budget_bytes = STATIC_WEIGHT_BYTES // 2
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await models.ReloadModel(model_pb.ReloadModelRequest(name="static-b"))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # a stayed on the device: taking it off would have made no room.
    assert metric_sum(server.registry, MODEL_EVICTIONS_TOTAL) == 0
    assert metric_sum(server.registry, MODEL_RESIDENT, model="static-a") == 1


async def test_a_cold_start_that_cannot_fit_beside_what_stays_says_so_and_evicts_none(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    """a (on_demand) loads first into host memory, then b, resident, takes the room a
    needs: a's cold start cannot fit beside b whatever leaves, and says so."""
    config = tmp_path / "models.yaml"
    config.write_text("static-b:\n  residency: resident\n")
    per_model = CapabilitySettings(model_config=config).with_model_config().per_model
    server = await on_demand_in_room_for_one(
        start_capability,
        model_root,
        tmp_path,
        per_model=per_model,
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-a"))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "that cannot leave it (resident ones, versions being replaced or loaded)" in str(
        refused.value.details()
    )
    assert metric_sum(server.registry, MODEL_EVICTIONS_TOTAL) == 0


async def refill_under_way(server: CapabilityServer, model: str) -> None:
    """Return once `model`'s result-cache refill has computed its first chunk."""
    await wait_until(
        lambda: metric_sum(server.registry, RESULT_CACHE_WARMED_TOTAL, model=model) > 0,
        f"{model}'s refill under way",
    )


async def test_a_cache_refill_gives_its_room_to_a_callers_cold_start(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    """a's first call starts a refill of 10,000 texts; b's caller, once the refill is
    under way, needs a's room: the refill stops after its chunk in flight, and b is
    answered (it waited for the whole refill, about 0.8 s here, and one with a shorter
    deadline was refused); the rest of a's refill waits for a's next cold start."""
    (tmp_path / "hot.txt").write_text(
        "".join(f"text number {i} about the match and the market {i * 7}\n" for i in range(10000))
    )
    config = tmp_path / "models.yaml"
    config.write_text(
        "static-a:\n  residency: on_demand\n  idle_seconds: 3600\n  warm_texts: hot.txt\n"
        "static-b:\n  residency: on_demand\n  idle_seconds: 3600\n"
    )
    per_model = CapabilitySettings(model_config=config).with_model_config().per_model
    server = await on_demand_in_room_for_one(
        start_capability, model_root, tmp_path, result_cache_entries=20000, per_model=per_model
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        await stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-a"))
        # NOTE: not a fixed sleep (50 ms): the refill takes about 0.8 s here, and on a
        # machine several times faster it ended within it, before b asked for room.
        await refill_under_way(server, "static-a")
        answer = await stub.Classify(
            pb.ClassifyRequest(text=STRIKER, model="static-b"), timeout=5.0
        )
        assert answer.model.name == "static-b"
        await server.pool.wait_cache_refilled()
    evicted = {"model": "static-a", "reason": "budget"}
    assert metric_sum(server.registry, MODEL_EVICTIONS_TOTAL, **evicted) == 1
    # The rest of a's refill waits for its next cold start.
    warmed = metric_sum(server.registry, RESULT_CACHE_WARMED_TOTAL, model="static-a")
    assert 0 < warmed < 10000


async def test_a_cache_refill_goes_on_when_another_model_leaves_to_make_room(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    """Room for two: b idle, a refilling its cache, c's caller needs room. The refill
    pauses while room is made; b, the least recently used, leaves; a stays and its
    refill goes on to the end (it waited for a cold start that would never come)."""
    (tmp_path / "hot.txt").write_text(
        "".join(f"text number {i} about the match and the market {i * 7}\n" for i in range(10000))
    )
    config = tmp_path / "models.yaml"
    config.write_text(
        "static-a:\n  residency: on_demand\n  idle_seconds: 3600\n  warm_texts: hot.txt\n"
        + "".join(
            f"{name}:\n  residency: on_demand\n  idle_seconds: 3600\n"
            for name in ("static-b", "static-c")
        )
    )
    per_model = CapabilitySettings(model_config=config).with_model_config().per_model
    names = ("static-a", "static-b", "static-c")
    copy_under_names(model_root / MODEL / "1", tmp_path / "models", names)
    server = await start_capability(
        model_root=tmp_path / "models",
        default_model="static-a",
        residency="on_demand",
        idle_seconds=3600,
        result_cache_entries=20000,
        per_model=per_model,
    )
    # Room for a with either other, not for all three: set from the footprints
    # measured here, as on the CPU they are the resident set's growth over each load,
    # which varies (a's, loaded first, read 1.5 times its weights on one machine and
    # about its weights on another, where a fixed 3.2 weights held all three).
    worker = server.pool.workers[0]
    ledgers = {name: worker.replicas[name].ledger for name in names}
    footprints = {name: ledger.footprint_bytes for name, ledger in ledgers.items() if ledger}
    others = footprints["static-b"], footprints["static-c"]
    worker.memory_budget_bytes = footprints["static-a"] + max(others) + min(others) // 2
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        await stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-b"))
        await stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-a"))
        await refill_under_way(server, "static-a")  # as above: not a fixed sleep
        answer = await stub.Classify(
            pb.ClassifyRequest(text=STRIKER, model="static-c"), timeout=5.0
        )
        assert answer.model.name == "static-c"
        await server.pool.wait_cache_refilled()
    evictions = {
        name: metric_sum(server.registry, MODEL_EVICTIONS_TOTAL, model=name) for name in names
    }
    assert evictions == {"static-a": 0, "static-b": 1, "static-c": 0}
    warmed = metric_sum(server.registry, RESULT_CACHE_WARMED_TOTAL, model="static-a")
    assert warmed == 10000


async def test_an_eviction_whose_caller_gives_up_still_takes_the_weights_off(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    """b's cold start evicts a, and its caller's deadline passes while the eviction
    waits for the device thread: the weights counted as off the device, the thread
    skipped the cancelled job, and they stayed on it, uncounted."""
    server = await on_demand_in_room_for_one(start_capability, model_root, tmp_path)
    worker = server.pool.workers[0]
    a = worker.replicas["static-a"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        await stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-a"))
        async with device_occupied(worker, take_turn=False):
            with pytest.raises(grpc.aio.AioRpcError) as expired:
                await stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-b"), timeout=1.0)
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_until(lambda: metric_sum(server.registry, MODEL_EVICTIONS_TOTAL) == 1, "evicted")
    assert not a.is_resident
    assert next(a.bundle.classifier.encoder.parameters()).device.type == "meta"
    assert metric_sum(server.registry, MODEL_RESIDENT, model="static-a") == 0


async def test_a_stop_during_an_eviction_whose_caller_left_waits_for_it(
    start_capability: StartCapability,
    model_root: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The stop closed the device thread under the eviction, which then failed unseen
    ("Task exception was never retrieved": the device thread is closed)."""
    server = await on_demand_in_room_for_one(start_capability, model_root, tmp_path)
    worker = server.pool.workers[0]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        await stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-a"))
        async with device_occupied(worker, take_turn=False):
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-b"), timeout=1.0)
            stopping = asyncio.ensure_future(server.stop(grace_seconds=0))
            await asyncio.sleep(0.2)  # the stop reaches the workers' close meanwhile
    await stopping
    gc.collect()  # where an unread task exception is reported
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert metric_sum(server.registry, MODEL_EVICTIONS_TOTAL) == 1


async def test_on_demand_models_with_warm_texts_start_in_room_for_one_and_warm_at_first_call(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    (tmp_path / "hot.txt").write_text("\n".join(TOPICAL_TEXTS) + "\n")
    config = tmp_path / "models.yaml"
    config.write_text(
        "".join(
            f"{name}:\n  residency: on_demand\n  idle_seconds: 3600\n  warm_texts: hot.txt\n"
            for name in ("static-a", "static-b")
        )
    )
    per_model = CapabilitySettings(model_config=config).with_model_config().per_model
    server = await on_demand_in_room_for_one(
        start_capability, model_root, tmp_path, result_cache_entries=1000, per_model=per_model
    )
    # Loading wakes no model: the refill waits for each model's first call.
    await server.pool.wait_cache_refilled()
    assert metric_sum(server.registry, MODEL_COLD_STARTS_TOTAL) == 0
    assert metric_sum(server.registry, RESULT_CACHE_WARMED_TOTAL) == 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        first = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-a"))
        assert not first.cached
        await server.pool.wait_cache_refilled()
        warmed = metric_sum(server.registry, RESULT_CACHE_WARMED_TOTAL, model="static-a")
        assert warmed == len(TOPICAL_TEXTS)
        again = await stub.Classify(pb.ClassifyRequest(text=TOPICAL_TEXTS[1], model="static-a"))
        assert again.cached
    assert metric_sum(server.registry, RESULT_CACHE_WARMED_TOTAL, model="static-b") == 0
    assert metric_sum(server.registry, MODEL_COLD_STARTS_TOTAL) == 1


async def test_a_cold_start_without_room_in_time_is_refused_for_memory_and_the_call_falls_back(
    start_capability: StartCapability,
    capability: CapabilityServer,
    orchestrator_with: StartOrchestrator,
    model_root: Path,
    tmp_path: Path,
) -> None:
    cold = await on_demand_in_room_for_one(start_capability, model_root, tmp_path)
    # The backend's timeout (0.7 s) is the capability's deadline: it refuses the cold
    # start before that, leaving the fallback most of the caller's other 0.8 s. (With the
    # caller's whole deadline upstream, the refusal came with only the orchestrator's
    # margin left, a few milliseconds that a slow machine's fallback could overrun.) The
    # default retry policy: the refusal asks for a wait (1 s) longer than the call has
    # left, so the lone replica is not asked again and the refusal goes straight to the
    # fallback.
    front = await orchestrator_with(
        f"""version: 1
backends:
  cold:
    model: static-b
    targets: ["127.0.0.1:{cold.port}"]
    timeout: 700ms
  static:
    model: topic-static
    targets: ["127.0.0.1:{capability.port}"]
routes:
  - name: default
    backend: cold
    fallback: [static]
"""
    )
    worker = cold.pool.workers[0]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cold.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        await stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-a"))
        async with device_occupied(worker):
            # a is busy (queued behind the held device) for longer than the call's deadline.
            busy = asyncio.ensure_future(
                stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-a"), timeout=30)
            )
            await wait_until(lambda: worker.replicas["static-a"].load == 1)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{front.port}") as front_channel:
                front_stub = classify_service_pb2_grpc.ClassifyServiceStub(front_channel)
                answer = await front_stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=1.5)
        await busy
    assert answer.fallback
    assert (answer.model.name, answer.labels[0].name) == ("topic-static", "sports")
    fell_back = metric_sum(
        front.registry, MODEL_FALLBACK_TOTAL, reason="DEVICE_MEMORY_PRESSURE", route="default"
    )
    assert fell_back == 1
    refused = {"model": "static-b", "reason": "DEVICE_MEMORY_PRESSURE"}
    assert metric_sum(cold.registry, ADMISSIONS_REFUSED_TOTAL, **refused) == 1
    assert metric_sum(cold.registry, MODEL_COLD_STARTS_TOTAL, model="static-b") == 0


async def test_a_cold_start_queued_behind_one_waiting_for_room_is_refused_for_memory_in_time(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    names = ("static-a", "static-b", "static-c")
    server = await on_demand_in_room_for_one(start_capability, model_root, tmp_path, names)
    worker = server.pool.workers[0]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)

        def classify(name: str, timeout: float) -> Any:
            return asyncio.ensure_future(
                stub.Classify(pb.ClassifyRequest(text=STRIKER, model=name), timeout=timeout)
            )

        await classify("static-a", 30)
        async with device_occupied(worker):
            busy = classify("static-a", 30)
            await wait_until(lambda: worker.replicas["static-a"].load == 1)
            waiting = classify("static-b", 30)  # holds the residency lock, waiting for room
            await wait_until(lambda: worker._residency.locked())
            # c's cold start queues behind b's: refused once it could no longer answer in
            # time, before its deadline (at it, the caller would read DEADLINE_EXCEEDED).
            refused = await refusal(classify("static-c", 1.0))
        await asyncio.gather(busy, waiting)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_info(refused).reason == "DEVICE_MEMORY_PRESSURE"


async def test_a_text_of_a_model_copied_on_meanwhile_waits_for_no_later_cold_start(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    """a1's cold start runs; b1 then a2 wait for the residency lock. b1 took it next
    and waited for a to go idle to make room, while a2, counted as a's load, waited for
    the lock b1 held: each waited for the other until b1 gave up (10 s without a
    deadline), refused RESOURCE_EXHAUSTED, and a, on the device, answered nothing."""
    server = await on_demand_in_room_for_one(start_capability, model_root, tmp_path)
    worker = server.pool.workers[0]
    a, b = worker.replicas["static-a"], worker.replicas["static-b"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)

        def classify(name: str) -> Any:
            return asyncio.ensure_future(
                stub.Classify(pb.ClassifyRequest(text=STRIKER, model=name))
            )

        async with device_occupied(worker):  # a1's copy waits for the device meanwhile
            a1 = classify("static-a")
            await wait_until(worker._residency.locked, "a1's cold start under way")
            b1 = classify("static-b")
            await wait_until(lambda: b.arriving == 1, "b1 waiting")
            a2 = classify("static-a")
            await wait_until(lambda: a.arriving == 2, "a2 waiting")
        answers = await asyncio.gather(a1, b1, a2)
    assert [answer.model.name for answer in answers] == ["static-a", "static-b", "static-a"]
    assert metric_sum(server.registry, MODEL_COLD_STARTS_TOTAL) == 2


async def test_a_cold_start_whose_caller_left_during_the_copy_is_counted_and_shown(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    """The caller's deadline passed while the copy waited for the device: the device
    thread still copied the weights on, but the cold start was neither counted nor
    timed, and the model was shown off the device while it was on it."""
    server = await on_demand_in_room_for_one(start_capability, model_root, tmp_path)
    worker = server.pool.workers[0]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        async with device_occupied(worker):
            with pytest.raises(grpc.aio.AioRpcError) as expired:
                await stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-a"), timeout=1)
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_until(
        lambda: metric_sum(server.registry, MODEL_COLD_STARTS_TOTAL) == 1, "cold start counted"
    )
    a = worker.replicas["static-a"]
    assert a.is_resident
    assert a.cold_start_seconds is not None
    assert a.cold_start_seconds >= 0.5  # it waited for the device
    assert metric_sum(server.registry, MODEL_RESIDENT, model="static-a") == 1


async def test_result_cache_hits_do_not_keep_an_on_demand_model_on_the_device(
    start_capability: StartCapability,
) -> None:
    server = await start_capability(
        models=(MODEL,), residency="on_demand", idle_seconds=0.5, result_cache_entries=1000
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL))
        # Hit after hit for three idle periods: no device work, so the model goes idle.
        loop = asyncio.get_running_loop()
        until = loop.time() + 1.5
        while loop.time() < until:
            hit = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL))
            assert hit.cached
            await asyncio.sleep(0.05)
    assert counted(server, MODEL_EVICTIONS_TOTAL, reason="idle", **ON_CPU) == 1
    assert not await resident_now(server)
    assert counted(server, MODEL_COLD_STARTS_TOTAL, **ON_CPU) == 1
