"""A text of which the model's vocabulary knows no token, over real servers and bundles.

Emoji, symbols and scripts outside the vocabulary each become [UNK]. Such a text
was classified all the same: "😀😀😀 🎉🎉" came back `world 0.946` from
topic-minilm, the model's bias given with confidence. It is refused now,
INVALID_ARGUMENT (UNREADABLE_TEXT) naming the field, before the result cache and
the queue; a route's fallback, a model with another vocabulary, may still read it,
and a text with one known word among the unknown ones is classified as before.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from google.rpc import error_details_pb2

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.bundle import load_bundle, write_manifest
from capability.metrics import ADMISSIONS_REFUSED_TOTAL
from capability.server import CapabilityServer
from classify_common.metrics import INTERNAL_ERRORS_TOTAL
from orchestrator.metrics import (
    MODEL_FALLBACK_TOTAL,
    OUTLIER_EJECTIONS_TOTAL,
    UPSTREAM_RETRIES_TOTAL,
)
from tests.conftest import STRIKER, StartCapability, StartOrchestrator, metric_sum
from tests.status_details import error_reason, refusal, unpack, violations_of

EMOJI = "😀 😀 🎉🎉"
SYMBOLS = "ⓐⓑⓒ"
# Zero-width spaces: the normalizer drops them. The contract refuses such a text first
# (it has no character that is not a space), so only the tokenizer sees it here.
NO_TOKENS = "\u200b\u200b"
ONE_WORD_AMONG_EMOJI = "😀 goal 🎉"
RULE = "text.readable"
STATIC = "topic-static"


def test_the_tokenizer_marks_texts_with_no_known_token(model_root: Path) -> None:
    tokenizer = load_bundle(model_root / STATIC / "1", torch.device("cpu")).classifier.tokenizer
    texts = [EMOJI, NO_TOKENS, ONE_WORD_AMONG_EMOJI, STRIKER, SYMBOLS, "Привет"]
    readable = [encoded.readable for encoded in tokenizer.encode_each(texts, 128)]
    assert readable == [False, False, True, True, False, True]
    # What the model reads is what counts: a known word past the budget is not read.
    assert not tokenizer.encode_each(["😀 " * 10 + "goal"], 6)[0].readable


async def test_the_capability_refuses_it_naming_the_field_and_computes_nothing(
    capability: CapabilityServer,
) -> None:
    replica = capability.pool.workers[0].replicas[STATIC]
    forwards = replica.bundle.classifier.forward_count
    refused_before = metric_sum(
        capability.registry, ADMISSIONS_REFUSED_TOTAL, model=STATIC, reason="UNREADABLE_TEXT"
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        alone = await refusal(stub.Classify(pb.ClassifyRequest(text=EMOJI, model=STATIC)))
        batch = await stub.ClassifyBatch(
            pb.ClassifyBatchRequest(
                items=[
                    pb.ClassifyRequest(text=text, model=STATIC)
                    for text in (SYMBOLS, STRIKER, ONE_WORD_AMONG_EMOJI)
                ]
            )
        )
    assert alone.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(alone) == "UNREADABLE_TEXT"
    assert violations_of(alone) == [("text", RULE)]
    assert f"model {STATIC}" in (alone.details() or "")
    symbols, striker, one_word = batch.results
    (bad_request,) = unpack(symbols.error, error_details_pb2.BadRequest)
    assert [(v.field, v.reason) for v in bad_request.field_violations] == [("text", RULE)]
    assert striker.response.labels[0].name == "sports"
    assert one_word.HasField("response")
    # The one batch's forward: the two readable texts; neither refused text reached it.
    assert replica.bundle.classifier.forward_count == forwards + 1
    refused = metric_sum(
        capability.registry, ADMISSIONS_REFUSED_TOTAL, model=STATIC, reason="UNREADABLE_TEXT"
    )
    assert refused == refused_before + 2


@pytest.fixture
async def emoji_reader(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> CapabilityServer:
    """topic-static whose vocabulary has 😀 in place of one of BERT's unused tokens."""
    bundle = tmp_path / "models" / STATIC / "1"
    shutil.copytree(model_root / STATIC / "1", bundle)
    (bundle / "manifest.json.sig").unlink(missing_ok=True)
    tokenizer = json.loads((bundle / "tokenizer.json").read_text())
    vocabulary = tokenizer["model"]["vocab"]
    vocabulary["😀"] = vocabulary.pop("[unused1]")
    (bundle / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    write_manifest(bundle)
    return await start_capability(model_root=tmp_path / "models", models=(STATIC,))


async def test_the_front_door_falls_back_to_a_model_that_reads_it_and_names_the_item(
    capability: CapabilityServer,
    emoji_reader: CapabilityServer,
    orchestrator_with: StartOrchestrator,
) -> None:
    replica = f"127.0.0.1:{capability.port}"
    server = await orchestrator_with(
        "version: 1\n"
        "outlier_ejection: {consecutive_failures: 2}\n"
        "backends:\n"
        f"  minilm: {{model: topic-minilm, targets: ['{replica}', '{replica}']}}\n"
        f"  emoji: {{model: {STATIC}, targets: ['127.0.0.1:{emoji_reader.port}']}}\n"
        "routes:\n"
        "  - name: alone\n"
        "    match: {header: {name: x-route, values: [alone]}}\n"
        "    backend: minilm\n"
        "  - name: default\n"
        "    backend: minilm\n"
        "    fallback: [emoji]\n"
    )
    alone = (("x-route", "alone"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        answered = [await stub.Classify(pb.ClassifyRequest(text=EMOJI)) for _ in range(3)]
        refused = await refusal(stub.Classify(pb.ClassifyRequest(text=EMOJI), metadata=alone))
        # Sent one by one and together, so that both the unary and the batch call
        # upstream carry the refusals.
        batch = await stub.ClassifyBatch(
            pb.ClassifyBatchRequest(
                items=[pb.ClassifyRequest(text=t) for t in (STRIKER, EMOJI, SYMBOLS)]
            ),
            metadata=alone,
        )
    assert {(a.model.name, a.fallback) for a in answered} == {(STATIC, True)}
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(refused) == "UNREADABLE_TEXT"
    assert violations_of(refused) == [("text", RULE)]
    striker, emoji, symbols = batch.results
    assert striker.response.labels[0].name == "sports"
    for index, item in ((1, emoji), (2, symbols)):
        assert item.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        (bad_request,) = unpack(item.error, error_details_pb2.BadRequest)
        fields = [(v.field, v.reason) for v in bad_request.field_violations]
        assert fields == [(f"items[{index}].text", RULE)]
        assert f"items[{index}].text" in item.error.message
    registry = server.registry
    fallbacks = {"route": "default", "from": "minilm", "to": "emoji"}
    assert metric_sum(registry, MODEL_FALLBACK_TOTAL, **fallbacks, reason="UNREADABLE_TEXT") == 3
    # The caller's text, not the replica: neither retried on the other one nor held
    # against it, and not a bug.
    assert metric_sum(registry, UPSTREAM_RETRIES_TOTAL) == 0
    assert metric_sum(registry, OUTLIER_EJECTIONS_TOTAL) == 0
    assert metric_sum(registry, INTERNAL_ERRORS_TOTAL) == 0
