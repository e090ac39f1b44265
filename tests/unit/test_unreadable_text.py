"""A text of which the model's vocabulary knows no token, over real servers and bundles.

Emoji, symbols and scripts outside the vocabulary each become [UNK]. Such a text
was classified all the same: "😀😀😀 🎉🎉" came back `world 0.946` from
topic-minilm, the model's bias given with confidence. It is refused now,
INVALID_ARGUMENT (UNREADABLE_TEXT) naming the field, before the result cache and
the queue; a route's fallback, a model with another vocabulary, may still read it,
and a text with one known word among the unknown ones is classified as before.
"""

from __future__ import annotations

import collections
import json
import logging
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.bundle import load_bundle, write_manifest
from capability.bundle.minilm import parse_tokenizer
from capability.metrics import ADMISSIONS_REFUSED_TOTAL
from capability.server import CapabilityServer
from classify_common.errors import (
    BackendTimedOut,
    ConcurrencyLimited,
    DeadlineExpired,
    DeviceMemoryPressure,
    FieldViolation,
    InvalidRequest,
    ModelUnavailable,
    UnreadableText,
    is_routine_refusal,
)
from classify_common.intake import item_status
from classify_common.metrics import INTERNAL_ERRORS_TOTAL
from orchestrator.calls import _tells_more
from orchestrator.metrics import (
    MODEL_FALLBACK_TOTAL,
    OUTLIER_EJECTIONS_TOTAL,
    UPSTREAM_RETRIES_TOTAL,
)
from orchestrator.state.results import decode_error, encode_error
from orchestrator.upstream.errors import translate_item_status
from tests.conftest import STRIKER, StartCapability, StartOrchestrator, closed_port, metric_sum
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


def test_a_sentencepiece_tokenizer_marks_them_too() -> None:
    """A Unigram model names its unknown piece only by id, in its saved form (which the
    bundle loader reads), and puts its word-start mark, a known piece, before each
    character it lacks: an emoji text is ['▁', '<unk>', ...], which read as known."""
    pieces = ["[PAD]", "<unk>", "<s>", "</s>", "\u2581", "\u2581goal", "\u2581the"]
    unigram = Tokenizer(models.Unigram([(piece, -1.0) for piece in pieces], unk_id=1))
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 2), ("</s>", 3)]
    )
    data = unigram.to_str().encode()
    tokenizer = parse_tokenizer(data, "tokenizer.json", lowercase=False, vocab_size=len(pieces))
    texts = [EMOJI, ONE_WORD_AMONG_EMOJI, "the goal"]
    encoded = tokenizer.encode_each(texts, 16)
    assert encoded[0].ids == (2, 4, 1, 4, 1, 4, 1, 3)  # <s> ▁ <unk> ▁ <unk> ▁ <unk> </s>
    assert [text.readable for text in encoded] == [False, True, True]


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
    # As the contract's refusals of an item name it.
    assert [(v.field, v.reason) for v in bad_request.field_violations] == [("items[0].text", RULE)]
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


async def test_a_text_opening_with_a_page_of_whitespace_is_read_not_refused(
    capability: CapabilityServer,
) -> None:
    """Text from a PDF or a web page may open with thousands of blank lines: cut before
    tokenizing from its first character, such a text was refused UNREADABLE_TEXT."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        answer = await stub.Classify(pb.ClassifyRequest(text="\n" * 5_000 + STRIKER))
    assert (answer.labels[0].name, answer.truncated) == ("sports", False)


@pytest.mark.parametrize(
    "blank_start",
    ["\u200b" * 4_100, "\ufeff" + "\x00" * 4_100, "\u00ad" * 4_100, "\u2028\u3000" * 2_050],
    ids=["zero-width spaces", "a byte-order mark and NULs", "soft hyphens", "separators"],
)
async def test_a_text_opening_with_characters_the_contract_counts_as_blank_is_read(
    capability: CapabilityServer, blank_start: str
) -> None:
    """The window skipped whitespace only: past a window's worth of characters the
    tokenizer drops unread (but `\\s` does not match), such a text was cut to nothing
    the model reads and refused UNREADABLE_TEXT."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        answer = await stub.Classify(pb.ClassifyRequest(text=blank_start + STRIKER))
    assert (answer.labels[0].name, answer.truncated) == ("sports", False)


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


async def test_a_primary_down_and_a_fallback_that_cannot_read_it_answer_unavailable(
    capability: CapabilityServer, orchestrator_with: StartOrchestrator
) -> None:
    """The primary, back, may read the text: the caller is told to try again
    (UNAVAILABLE), not never to (INVALID_ARGUMENT)."""
    server = await orchestrator_with(
        "version: 1\n"
        "backends:\n"
        f"  down: {{model: topic-minilm, targets: ['127.0.0.1:{closed_port()}']}}\n"
        f"  static: {{model: {STATIC}, targets: ['127.0.0.1:{capability.port}']}}\n"
        "routes:\n"
        "  - name: default\n"
        "    backend: down\n"
        "    fallback: [static]\n"
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        refused = await refusal(stub.Classify(pb.ClassifyRequest(text=EMOJI), timeout=10))
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason(refused) == "MODEL_UNAVAILABLE"


def test_an_unreadable_text_is_the_failure_the_caller_hears_only_when_nothing_else_failed() -> None:
    """After a primary that cannot read the text, a fallback at its limit is what the
    caller hears (RESOURCE_EXHAUSTED, retry after the hint: once the fallback has
    room, it may read it); a fallback that cannot read it never hides the primary's
    outage."""
    unreadable = UnreadableText.for_model(STATIC)
    down = ModelUnavailable("backend minilm is unavailable")
    at_its_limit = ConcurrencyLimited("backend static is at its limit", retry_after_seconds=1.0)
    assert _tells_more(unreadable, None)
    assert not _tells_more(unreadable, down)
    assert _tells_more(at_its_limit, unreadable)
    assert _tells_more(down, unreadable)
    assert not _tells_more(at_its_limit, down)  # as before: a refusal says less


def test_a_stored_refusal_keeps_its_field_violation() -> None:
    """A PROCESSING call's result kept in Redis, read by GetResult on any orchestrator."""
    stored = decode_error(encode_error(UnreadableText.for_model(STATIC)))
    assert isinstance(stored, UnreadableText)
    assert [(v.field, v.rule) for v in stored.violations] == [("text", RULE)]


def test_a_capability_item_path_is_read_relative_to_the_text_sent() -> None:
    """A capability names a batch item's field by its place in the orchestrator's
    call (`items[2].…`); the caller's item is elsewhere in its own call, or is a
    single call."""
    status = item_status(
        InvalidRequest([FieldViolation("items[2].max_length", "int32.lte", "too many")]), "r", "t"
    )
    error = translate_item_status(status, "minilm", "127.0.0.1:1")
    assert isinstance(error, InvalidRequest)
    assert [v.field for v in error.violations] == ["max_length"]
    assert [v.field for v in error.within("items[5]").violations] == ["items[5].max_length"]


async def test_a_batch_of_texts_no_model_reads_writes_no_warning_and_a_line_per_item(
    capability: CapabilityServer,
    orchestrator_with: StartOrchestrator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each refused item was logged per attempt and per backend, WARNINGs among them, in
    both servers: 1,024 such texts in an 8 KB call wrote 5,121 orchestrator lines and
    2,064 capability lines. The caller's text is nothing to repair in a server: each
    item keeps its one line, the orchestrator's `batch item failed`, at INFO."""
    replica = f"127.0.0.1:{capability.port}"
    server = await orchestrator_with(
        "version: 1\n"
        "backends:\n"
        f"  minilm: {{model: topic-minilm, targets: ['{replica}']}}\n"
        f"  static: {{model: {STATIC}, targets: ['{replica}']}}\n"
        "routes:\n"
        "  - name: default\n"
        "    backend: minilm\n"
        "    fallback: [static]\n"
    )
    items = [pb.ClassifyRequest(text=EMOJI, request_id=f"emoji-{i}") for i in range(64)]
    with caplog.at_level(logging.INFO):
        caplog.clear()  # the start's lines
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            batch = await stub.ClassifyBatch(pb.ClassifyBatchRequest(items=items), timeout=30)
    assert {result.error.code for result in batch.results} == {
        grpc.StatusCode.INVALID_ARGUMENT.value[0]
    }
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    # One line per item (its own IDs come from the context it ran in), and none from
    # the attempts, the fallback or the capability's items.
    lines = collections.Counter((r.name, r.getMessage()) for r in caplog.records)
    assert lines[("orchestrator.batch_items", "batch item failed")] == 64
    noisy = ("capability.service", "orchestrator.upstream.errors", "orchestrator.calls")
    assert [line for line in lines if line[0] in noisy] == []


@pytest.mark.parametrize(
    ("error", "routine"),
    [
        (UnreadableText([FieldViolation("text", RULE, "no word")]), True),
        (InvalidRequest([FieldViolation("text", "string.min_len", "empty")]), True),
        (ConcurrencyLimited("over the limit", retry_after_seconds=0.1), True),
        (DeadlineExpired("out of time"), True),
        (DeviceMemoryPressure("device memory past its threshold", retry_after_seconds=1.0), False),
        (BackendTimedOut("no answer within the backend's timeout"), False),
        (ModelUnavailable("no replica"), False),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else str(value),
)
def test_only_refusals_of_a_text_or_for_load_are_routine(error: Exception, routine: bool) -> None:
    """Routine ones are logged at DEBUG per attempt; a device short of memory or a slow
    backend is something to repair, and keeps its WARNING."""
    assert is_routine_refusal(error) is routine  # type: ignore[arg-type]
