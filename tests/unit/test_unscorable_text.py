"""A text the model cannot score (non-finite scores) while it scores others, over real
servers and a real bundle whose embedding of one word overflows (as half precision
can for some inputs).

It was answered UNAVAILABLE (MODEL_FAULT), like a broken replica: retried on every
replica and by the client (an audit saw one text computed 12 times) and counted
towards ejecting a healthy replica. It is UNSCORABLE_TEXT (INTERNAL) now: neither
retried nor held against the replica, and the route's fallback, another model, may
still score it."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import grpc
import pytest
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.batching.batcher import PROBE_TEXT
from capability.bundle import write_manifest
from capability.metrics import BATCH_FAILURES_TOTAL, UNSCORABLE_TEXTS_TOTAL
from capability.server import CapabilityServer
from classify_common.metrics import INTERNAL_ERRORS_TOTAL
from orchestrator.metrics import (
    MODEL_FALLBACK_TOTAL,
    OUTLIER_EJECTIONS_TOTAL,
    UPSTREAM_RETRIES_TOTAL,
)
from tests.conftest import STRIKER, StartCapability, StartOrchestrator, metric_sum
from tests.status_details import error_info, refusal

MODEL = "topic-minilm"
POISON = "A zebra crossed the road"


def model_root_with_a_poisoned_word(
    model_root: Path, root: Path, words: tuple[str, ...] = ("zebra",)
) -> Path:
    """topic-minilm version 1 whose embedding of each of `words` overflows to
    non-finite scores; every other text scores as before."""
    bundle = root / MODEL / "1"
    shutil.copytree(model_root / MODEL / "1", bundle)
    (bundle / "manifest.json.sig").unlink(missing_ok=True)
    tokenizer = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    embeddings = load_file(bundle / "embeddings.safetensors")
    for word in words:
        embeddings["embeddings.word_embeddings.weight"][tokenizer.token_to_id(word)] = 3e38
    save_file(embeddings, bundle / "embeddings.safetensors")
    write_manifest(bundle)
    return root


@pytest.fixture
async def poisoned(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> CapabilityServer:
    root = model_root_with_a_poisoned_word(model_root, tmp_path / "models")
    return await start_capability(model_root=root, models=(MODEL,))


async def test_the_capability_answers_the_text_unscorable_and_the_others(
    poisoned: CapabilityServer,
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{poisoned.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        # Alone, the model is probed with a text of its own to tell the text from a
        # broken model.
        alone = await refusal(stub.Classify(pb.ClassifyRequest(text=POISON)))
        batch = await stub.ClassifyBatch(
            pb.ClassifyBatchRequest(
                items=[pb.ClassifyRequest(text=POISON), pb.ClassifyRequest(text=STRIKER)]
            )
        )
    assert alone.code() == grpc.StatusCode.INTERNAL
    assert error_info(alone).reason == "UNSCORABLE_TEXT"
    assert "non-finite" in (alone.details() or "")
    unscorable, scored = batch.results
    assert unscorable.error.code == grpc.StatusCode.INTERNAL.value[0]
    assert scored.response.labels[0].name == "sports"
    registry = poisoned.registry
    assert metric_sum(registry, UNSCORABLE_TEXTS_TOTAL, model=MODEL) == 2
    assert metric_sum(registry, BATCH_FAILURES_TOTAL, model=MODEL) == 0


async def test_a_model_that_scores_no_text_is_a_counted_and_logged_batch_failure(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The probe text scores non-finite too, so the model is what is broken here: the
    runbook's device check (the counter and the log line `batch failed`) must see it."""
    probe_word = PROBE_TEXT.split()[1]  # "committee"
    root = model_root_with_a_poisoned_word(model_root, tmp_path / "models", ("zebra", probe_word))
    broken = await start_capability(model_root=root, models=(MODEL,))
    with caplog.at_level(logging.ERROR, logger="capability"):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{broken.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            failed = await refusal(stub.Classify(pb.ClassifyRequest(text=POISON)))
    assert failed.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(failed).reason == "MODEL_FAULT"
    assert metric_sum(broken.registry, BATCH_FAILURES_TOTAL, model=MODEL) == 1
    assert metric_sum(broken.registry, UNSCORABLE_TEXTS_TOTAL, model=MODEL) == 0
    (line,) = [r for r in caplog.records if r.getMessage() == "batch failed"]
    assert (line.model, line.worker) == (MODEL, "cpu:0")  # type: ignore[attr-defined]
    assert "non-finite" in str(line.reason)  # type: ignore[attr-defined]


async def test_the_front_door_neither_retries_nor_ejects_and_the_fallback_scores_it(
    poisoned: CapabilityServer,
    capability: CapabilityServer,
    orchestrator_with: StartOrchestrator,
) -> None:
    replica = f"127.0.0.1:{poisoned.port}"
    server = await orchestrator_with(
        "version: 1\n"
        "outlier_ejection: {consecutive_failures: 2}\n"
        "backends:\n"
        f"  minilm: {{model: {MODEL}, targets: ['{replica}', '{replica}']}}\n"
        f"  static: {{model: topic-static, targets: ['127.0.0.1:{capability.port}']}}\n"
        "routes:\n"
        "  - name: alone\n"
        "    match: {header: {name: x-route, values: [alone]}}\n"
        "    backend: minilm\n"
        "  - name: default\n"
        "    backend: minilm\n"
        "    fallback: [static]\n"
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        answered = [await stub.Classify(pb.ClassifyRequest(text=POISON)) for _ in range(3)]
        refused = await refusal(
            stub.Classify(pb.ClassifyRequest(text=POISON), metadata=(("x-route", "alone"),))
        )
        scored = await stub.Classify(pb.ClassifyRequest(text=STRIKER))
    assert {(a.model.name, a.fallback) for a in answered} == {("topic-static", True)}
    assert (scored.model.name, scored.fallback) == (MODEL, False)
    assert refused.code() == grpc.StatusCode.INTERNAL
    info = error_info(refused)
    assert (info.reason, info.metadata["backend"]) == ("UNSCORABLE_TEXT", "minilm")
    assert info.metadata["x-request-id"]
    assert info.metadata["x-trace-id"]
    registry = server.registry
    fallbacks = {"route": "default", "from": "minilm", "to": "static"}
    assert metric_sum(registry, MODEL_FALLBACK_TOTAL, **fallbacks, reason="UNSCORABLE_TEXT") == 3
    assert metric_sum(registry, UPSTREAM_RETRIES_TOTAL) == 0
    assert metric_sum(registry, OUTLIER_EJECTIONS_TOTAL) == 0
    assert metric_sum(registry, INTERNAL_ERRORS_TOTAL) == 0  # the model's fault, not a bug
    # Once per call: never computed again on the other replica.
    assert metric_sum(poisoned.registry, UNSCORABLE_TEXTS_TOTAL, model=MODEL) == 4
