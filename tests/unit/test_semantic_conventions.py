"""Span attributes follow OpenTelemetry's semantic conventions as the pinned
opentelemetry-semantic-conventions package spells them: every standard key the
project emits is one the package defines and does not mark deprecated, and a table
of calls through real servers holds each span's attributes and status to what the
RPC conventions say."""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import opentelemetry.semconv
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from classify_common import nodes
from classify_common.nodes import NODES, peer_attributes, server_attributes
from orchestrator.server import OrchestratorServer
from tests.conftest import STRIKER, StartOrchestrator, closed_port, routes_text, wait_until
from tests.status_details import trailers_of

CLASSIFY = "ai.classify.v1.ClassifyService/Classify"


def semconv_keys() -> tuple[set[str], set[str]]:
    """Every attribute key the package defines, and those it marks deprecated (the
    string under a constant starts with "Deprecated", except "Deprecated in favor of
    stable": the incubating copy of a key that became stable, the same key)."""
    defined: set[str] = set()
    deprecated: set[str] = set()
    root = Path(opentelemetry.semconv.__file__).parent
    for path in root.rglob("*_attributes.py"):
        body = ast.parse(path.read_text()).body
        for statement, following in zip(body, [*body[1:], None], strict=True):
            if not (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.value, ast.Constant)
                and isinstance(statement.value.value, str)
            ):
                continue
            key = statement.value.value
            defined.add(key)
            doc = (
                following.value.value
                if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                else ""
            )
            if (
                isinstance(doc, str)
                and doc.strip().startswith("Deprecated")
                and not doc.strip().startswith("Deprecated in favor of stable")
            ):
                deprecated.add(key)
    return defined, deprecated


def emitted_standard_keys() -> set[str]:
    """The keys beside the node table that are not the project's own."""
    return {
        value
        for name, value in vars(nodes).items()
        if name.isupper()
        and isinstance(value, str)
        and "." in value
        and not value.startswith("classify.")
        and not value.startswith("ai.")  # method names
    }


def test_every_standard_key_is_defined_by_the_pinned_conventions_and_current() -> None:
    defined, deprecated = semconv_keys()
    keys = emitted_standard_keys()
    assert {"rpc.system.name", "rpc.method", "server.address", "error.type"} <= keys
    assert keys - defined == set()
    assert keys & deprecated == set()
    # The ones the conventions replaced are known to the check (it can fail).
    assert {"rpc.system", "rpc.grpc.status_code", "net.peer.name"} <= deprecated
    listed = {key for node in NODES for key in node.attributes} | set(nodes.ANY_NODE_ATTRIBUTES)
    assert {key for key in listed if not key.startswith("classify.")} - {"timeout"} <= keys


@pytest.mark.parametrize(
    ("peer", "expected"),
    [
        ("ipv4:10.0.0.7:5123", {"network.peer.address": "10.0.0.7", "network.peer.port": 5123}),
        ("ipv6:[::1]:443", {"network.peer.address": "::1", "network.peer.port": 443}),
        ("unix:/run/classify.sock", {"network.peer.address": "/run/classify.sock"}),
    ],
)
def test_network_peer_attributes_from_grpc_peer_strings(
    peer: str, expected: dict[str, object]
) -> None:
    assert peer_attributes(peer) == expected


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("capability:50061", {"server.address": "capability", "server.port": 50061}),
        ("[::1]:50061", {"server.address": "::1", "server.port": 50061}),
        ("dns:///capability", {"server.address": "dns:///capability"}),
    ],
)
def test_server_attributes_from_targets(target: str, expected: dict[str, object]) -> None:
    assert server_attributes(target) == expected


@dataclass(frozen=True)
class Expected:
    """One span of a call: which, its status, the attributes it must carry (a value of
    None: must not carry the key)."""

    kind: SpanKind
    process_root: bool  # the orchestrator's server span, not the capability's
    status: StatusCode
    attributes: Mapping[str, object]


OK_SERVER: dict[str, object] = {
    "rpc.system.name": "grpc",
    "rpc.method": CLASSIFY,
    "rpc.response.status_code": "OK",
    "error.type": None,
}
# (call, expected spans): "ok" to the live capability server, "invalid" an empty
# text, "dead" a route whose only backend refuses connections.
TABLE: list[tuple[str, list[Expected]]] = [
    (
        "ok",
        [
            Expected(SpanKind.SERVER, True, StatusCode.UNSET, OK_SERVER),
            Expected(SpanKind.SERVER, False, StatusCode.UNSET, OK_SERVER),
            Expected(
                SpanKind.CLIENT,
                False,
                StatusCode.UNSET,
                {
                    "rpc.system.name": "grpc",
                    "rpc.method": CLASSIFY,
                    "server.address": "127.0.0.1",
                    "rpc.response.status_code": "OK",
                    "error.type": None,
                },
            ),
        ],
    ),
    (
        "invalid",
        [
            Expected(
                SpanKind.SERVER,
                True,
                StatusCode.UNSET,  # the caller's fault: no error status, no error.type
                {**OK_SERVER, "rpc.response.status_code": "INVALID_ARGUMENT"},
            ),
        ],
    ),
    (
        "dead",
        [
            Expected(
                SpanKind.SERVER,
                True,
                StatusCode.ERROR,
                {
                    **OK_SERVER,
                    "rpc.response.status_code": "UNAVAILABLE",
                    "error.type": "UNAVAILABLE",
                },
            ),
            Expected(
                SpanKind.CLIENT,
                False,
                StatusCode.ERROR,
                {
                    "rpc.method": CLASSIFY,
                    "server.address": "127.0.0.1",
                    "rpc.response.status_code": "UNAVAILABLE",
                    "error.type": "UNAVAILABLE",
                },
            ),
        ],
    ),
]


async def call(port: int, text: str) -> str:
    """The trace ID of one Classify call, whatever it ended with."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        try:
            response = await stub.Classify(pb.ClassifyRequest(text=text), timeout=30)
        except grpc.aio.AioRpcError as error:
            return trailers_of(error)["x-trace-id"]
        return response.trace_id


def matching(spans: Sequence[ReadableSpan], expected: Expected) -> ReadableSpan:
    found = [
        s
        for s in spans
        if s.kind == expected.kind
        and (expected.kind != SpanKind.SERVER or (s.parent is None) == expected.process_root)
    ]
    assert found, expected
    return found[0]


@pytest.mark.parametrize(("case", "expected_spans"), TABLE, ids=[case for case, _ in TABLE])
async def test_spans_carry_what_the_rpc_conventions_say(
    case: str,
    expected_spans: list[Expected],
    orchestrator: OrchestratorServer,
    capability: CapabilityServer,
    orchestrator_with: StartOrchestrator,
    span_exporter: InMemorySpanExporter,
) -> None:
    port = orchestrator.port
    if case == "dead":
        port = (await orchestrator_with(routes_text([f"127.0.0.1:{closed_port()}"]))).port
    trace_id = await call(port, "" if case == "invalid" else STRIKER)

    def spans() -> list[ReadableSpan]:
        return [
            s
            for s in span_exporter.get_finished_spans()
            if s.context is not None and format(s.context.trace_id, "032x") == trace_id
        ]

    def all_there() -> bool:
        kinds = [(s.kind, s.parent is None) for s in spans()]
        return all(
            (e.kind, e.process_root) in kinds
            or (e.kind != SpanKind.SERVER and any(k == e.kind for k, _ in kinds))
            for e in expected_spans
        )

    await wait_until(all_there, f"the {case} call's spans")
    for expected in expected_spans:
        span = matching(spans(), expected)
        attributes = dict(span.attributes or {})
        assert span.status.status_code == expected.status, (case, span.name)
        for key, value in expected.attributes.items():
            assert attributes.get(key) == value, (case, span.name, key)
        if expected.kind == SpanKind.CLIENT:
            assert span.name == CLASSIFY
            assert isinstance(attributes["server.port"], int)
