"""Every protovalidate rule of the contract, rejected by a real server with the right
field violation, before any model work."""

from __future__ import annotations

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc, model_service_pb2_grpc
from ai.classify.v1 import model_service_pb2 as model_pb
from capability.metrics import MODEL_TEXTS_TOTAL
from capability.server import CapabilityServer
from classify_common.serving import CONTRACT_SERVICES
from classify_common.validation import compile_rules
from orchestrator.server import OrchestratorServer
from tests.conftest import STRIKER, metric_sum, wait_until
from tests.status_details import metadata_dict, refusal, trailers_of, violations_of
from tests.unit.test_lifecycle_trace import trace_spans


def texts_computed(server: CapabilityServer) -> float:
    return metric_sum(server.registry, MODEL_TEXTS_TOTAL, model="topic-minilm")


INVALID_REQUESTS = [
    pytest.param(pb.ClassifyRequest(text=""), [("text", "required")], id="empty-text"),
    pytest.param(pb.ClassifyRequest(text=" \t\n "), [("text", "text.not_blank")], id="blank-text"),
    *(
        pytest.param(pb.ClassifyRequest(text=blank), [("text", "text.not_blank")], id=name)
        for name, blank in (
            ("vertical-tab", "\v\v"),
            ("no-break-space", "\u00a0"),
            ("em-space", " \u2003 "),
            ("ideographic-space", "\u3000"),
            ("line-separator", "\u2028"),
            ("next-line", "\u0085"),
            ("zero-width-space", "\u200b\ufeff"),
            ("nul", "\x00"),
        )
    ),
    pytest.param(
        pb.ClassifyRequest(text="a" * 100_001), [("text", "string.max_len")], id="text-too-long"
    ),
    pytest.param(
        pb.ClassifyRequest(text="ok", max_length=0),
        [("max_length", "int32.gte_lte")],
        id="max-length-0",
    ),
    pytest.param(
        pb.ClassifyRequest(text="ok", max_length=1025),
        [("max_length", "int32.gte_lte")],
        id="max-length-1025",
    ),
    pytest.param(
        pb.ClassifyRequest(text="ok", top_k=0), [("top_k", "int32.gte_lte")], id="top-k-0"
    ),
    pytest.param(
        pb.ClassifyRequest(text="ok", top_k=101), [("top_k", "int32.gte_lte")], id="top-k-101"
    ),
    pytest.param(
        pb.ClassifyRequest(text="ok", model="Topic MiniLM"),
        [("model", "string.pattern")],
        id="model-pattern",
    ),
    pytest.param(
        pb.ClassifyRequest(text="ok", model="m" * 65),
        [("model", "string.max_len")],
        id="model-too-long",
    ),
    pytest.param(
        pb.ClassifyRequest(text="ok", priority=7),  # type: ignore[arg-type]
        [("priority", "enum.defined_only")],
        id="priority-undefined",
    ),
    pytest.param(
        pb.ClassifyRequest(text="ok", request_id="-starts-with-dash"),
        [("request_id", "string.pattern")],
        id="request-id-pattern",
    ),
    pytest.param(
        pb.ClassifyRequest(text="ok", request_id="r" * 129),
        [("request_id", "string.max_len")],
        id="request-id-too-long",
    ),
    pytest.param(
        pb.ClassifyRequest(text="", top_k=0, max_length=2000),
        [("text", "required"), ("max_length", "int32.gte_lte"), ("top_k", "int32.gte_lte")],
        id="three-rules-at-once",
    ),
]


@pytest.mark.parametrize(("request_message", "expected"), INVALID_REQUESTS)
async def test_orchestrator_rejects_each_broken_rule_with_its_field_violation(
    orchestrator_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
    capability: CapabilityServer,
    request_message: pb.ClassifyRequest,
    expected: list[tuple[str, str]],
) -> None:
    forwards_before = texts_computed(capability)
    error = await refusal(orchestrator_stub.Classify(request_message))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations_of(error) == expected
    trailers = trailers_of(error)
    assert trailers["x-request-id"]
    assert len(trailers["x-trace-id"]) == 32
    assert texts_computed(capability) == forwards_before


@pytest.mark.parametrize(("request_message", "expected"), INVALID_REQUESTS[:4])
async def test_capability_server_validates_on_its_own(
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
    capability: CapabilityServer,
    request_message: pb.ClassifyRequest,
    expected: list[tuple[str, str]],
) -> None:
    forwards_before = texts_computed(capability)
    error = await refusal(capability_stub.Classify(request_message))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations_of(error) == expected
    assert texts_computed(capability) == forwards_before


async def test_empty_text_never_reaches_the_model(
    orchestrator_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
    capability: CapabilityServer,
) -> None:
    served = capability.pool.serving("topic-minilm")
    passes_before = served.classifier.forward_count
    metric_before = texts_computed(capability)

    for stub in (orchestrator_stub, capability_stub):
        error = await refusal(stub.Classify(pb.ClassifyRequest(text="")))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert served.classifier.forward_count == passes_before
    assert texts_computed(capability) == metric_before

    # The counter does move for a request that is valid, by exactly one.
    await orchestrator_stub.Classify(pb.ClassifyRequest(text=STRIKER))
    assert served.classifier.forward_count == passes_before + 1
    assert texts_computed(capability) == metric_before + 1


async def test_text_of_exactly_100000_characters_is_accepted_and_truncated(
    orchestrator_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    # Characters, not bytes (150,000 of them in UTF-8), and words: one word of 100,000
    # characters would be a single [UNK], a text the model cannot read.
    text = "é " * 50_000
    response = await orchestrator_stub.Classify(pb.ClassifyRequest(text=text, top_k=1))
    assert response.status == pb.RESULT_STATUS_DONE
    assert len(response.labels) == 1


async def test_client_request_id_is_kept_and_reported_in_trailers(
    orchestrator_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    call = orchestrator_stub.Classify(pb.ClassifyRequest(text=STRIKER, request_id="client:42"))
    response = await call
    trailers = metadata_dict(await call.trailing_metadata())
    assert response.request_id == "client:42"
    assert trailers["x-request-id"] == "client:42"
    assert trailers["x-trace-id"] == response.trace_id


async def test_get_result_rejects_missing_request_id(
    orchestrator_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    error = await refusal(orchestrator_stub.GetResult(pb.GetResultRequest()))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations_of(error) == [("request_id", "required")]


async def test_model_service_rejects_malformed_model_name(
    model_stub: model_service_pb2_grpc.ModelServiceAsyncStub,
) -> None:
    error = await refusal(model_stub.GetModel(model_pb.GetModelRequest(name="Not A Name")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations_of(error) == [("name", "string.pattern")]


@pytest.mark.parametrize("text", ["\u0627\u0644\u0633\u0644\u0627\u0645", "\u00a0x\u3000"])
async def test_a_text_with_one_visible_character_is_not_blank(
    orchestrator_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub, text: str
) -> None:
    answer = await orchestrator_stub.Classify(pb.ClassifyRequest(text=text))
    assert answer.labels


@pytest.mark.parametrize("text", ["🙂", "\u200d🙂"])
async def test_an_emoji_is_not_blank_but_no_word_the_model_knows(
    orchestrator_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub, text: str
) -> None:
    """Past the contract's blank rule to the model, whose vocabulary has no token for
    it (tests/unit/test_unreadable_text.py)."""
    refused = await refusal(orchestrator_stub.Classify(pb.ClassifyRequest(text=text)))
    assert violations_of(refused) == [("text", "text.readable")]


async def test_bytes_that_are_no_request_message_are_refused_without_the_decoders_text(
    orchestrator: OrchestratorServer, span_exporter: InMemorySpanExporter
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        classify_raw: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/ai.classify.v1.ClassifyService/Classify"
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await classify_raw(b"\xff\xff\xff", timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == (
        "invalid request: not a protobuf request message of ai.classify.v1.ClassifyService/Classify"
    )
    assert violations_of(refused.value) == [("", "wire_format")]
    assert set(trailers_of(refused.value)) >= {"x-request-id", "x-trace-id"}
    # A refusal, not a bug: no error status on its receive node (a trace with an error
    # span is kept whatever the sampling, so any caller could have one exported).
    trace_id = trailers_of(refused.value)["x-trace-id"]
    await wait_until(lambda: len(trace_spans(span_exporter, trace_id)) >= 2, "its spans")
    (receive,) = [s for s in trace_spans(span_exporter, trace_id) if s.name == "grpc_receive"]
    assert receive.status.status_code is StatusCode.UNSET
    assert receive.attributes is not None
    assert receive.attributes["rpc.response.status_code"] == "INVALID_ARGUMENT"


async def test_a_text_that_is_not_utf8_is_refused_naming_the_field_and_byte(
    orchestrator: OrchestratorServer,
) -> None:
    """protobuf's decoder refuses such a message without naming the field (a C++
    client sends one: it checks UTF-8 only in debug builds)."""
    raw = pb.ClassifyRequest(text="Caf# prices", model="topic#").SerializeToString()
    raw = raw.replace(b"Caf#", b"Caf\xe9").replace(b"topic#", b"topic\xc3")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        classify_raw: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/ai.classify.v1.ClassifyService/Classify"
        )
        refused = await refusal(classify_raw(raw, timeout=10))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations_of(refused) == [("text", "utf8"), ("model", "utf8")]
    assert refused.details() == (
        "invalid request: text: must be UTF-8 (byte 0xe9 at offset 3 is not), "
        "model: must be UTF-8 (byte 0xc3 at offset 5 is not)"
    )
    assert set(trailers_of(refused)) >= {"x-request-id", "x-trace-id"}


def test_a_server_compiles_the_rules_of_every_request_type_it_takes_before_serving() -> None:
    """Compiled at a type's first check, the rules cost the first call a fresh server
    took 24-50 ms of its event loop, every call behind it waiting (compile_rules)."""
    assert sorted(compile_rules(CONTRACT_SERVICES)) == [
        "ai.classify.v1.ClassifyBatchRequest",
        "ai.classify.v1.ClassifyRequest",
        "ai.classify.v1.GetModelRequest",
        "ai.classify.v1.GetResultRequest",
        "ai.classify.v1.ListModelsRequest",
        "ai.classify.v1.ReloadModelRequest",
    ]
