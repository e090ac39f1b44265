"""Shadow traffic through a real orchestrator and real capability servers: the share of
answered calls sent to a route's shadow backend, compared and counted, never changing
or failing the caller's answer; and the `shadow` key of routes.yaml."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from classify_common.nodes import UPSTREAM_CALL
from orchestrator import shadow as shadow_module
from orchestrator.metrics import (
    MODEL_FALLBACK_TOTAL,
    REQUEST_DURATION_SECONDS,
    SHADOW_COMPARISONS_TOTAL,
    SHADOW_DROPPED_TOTAL,
    SHADOW_SCORE_DIFFERENCE,
    UPSTREAM_RETRIES_TOTAL,
)
from orchestrator.routing import RoutesFileError, load_routes
from orchestrator.routing.explain import explain
from orchestrator.routing.match import RequestFacts, shadow_slot
from orchestrator.server import OrchestratorServer
from orchestrator.shadow import compare
from orchestrator.upstream import errors as upstream_errors
from tests.conftest import (
    STRIKER,
    LineCollector,
    StartCapability,
    StartOrchestrator,
    closed_port,
    metric_sum,
    orchestrator_settings,
    wait_until,
)
from tests.flaky_pod import FlakyPod
from tests.unit.capability.test_serving import device_occupied

# Headlines on which topic-minilm and topic-static agree for some, not all.
SHORT_TEXTS = [
    "The striker scored twice in the final minutes of the cup match",
    "Shares fell sharply after the bank cut its profit forecast",
    "The new chip doubles battery life in laptops",
    "Rebels and the army agreed to a ceasefire in the capital",
    "The goalkeeper saved a penalty in extra time",
    "Central bank raises interest rates by half a point",
    "Astronomers detect water vapour on a distant exoplanet",
    "Parliament votes on the new election law today",
]


def shadow_routes(primary_target: str, shadow_model: str, shadow_target: str, **shadow: str) -> str:
    """One route, `default`, to topic-minilm, shadowed by `shadow_model` (100% unless
    `percent` is given); the shadow backend's other keys from `shadow`."""
    percent = shadow.pop("percent", "100")
    extra = "".join(f", {key}: {value}" for key, value in shadow.items())
    return f"""version: 1
backends:
  minilm: {{model: topic-minilm, targets: ["{primary_target}"]}}
  candidate: {{model: {shadow_model}, targets: ["{shadow_target}"]{extra}}}
routes:
  - name: default
    backend: minilm
    shadow: {{backend: candidate, percent: {percent}}}
"""


async def classify_texts(
    server: OrchestratorServer, texts: list[str], request_ids: list[str] | None = None
) -> list[pb.ClassifyResponse]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        ids = request_ids or [""] * len(texts)
        return [
            await stub.Classify(pb.ClassifyRequest(text=text, request_id=rid), timeout=30)
            for text, rid in zip(texts, ids, strict=True)
        ]


async def top_labels(capability: CapabilityServer, model: str, texts: list[str]) -> list[str]:
    """Each text's top label from the capability server directly: the expected answers."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        answers = [
            await stub.Classify(pb.ClassifyRequest(text=text, model=model), timeout=30)
            for text in texts
        ]
    return [answer.labels[0].name for answer in answers]


def comparisons(server: OrchestratorServer, outcome: str) -> float:
    return metric_sum(
        server.registry,
        SHADOW_COMPARISONS_TOTAL,
        route="default",
        primary="minilm",
        shadow="candidate",
        outcome=outcome,
    )


def compared(server: OrchestratorServer) -> float:
    return sum(comparisons(server, outcome) for outcome in ("agree", "disagree", "error"))


async def test_shadow_of_the_same_model_agrees_on_every_call(
    orchestrator_with: StartOrchestrator, capability: CapabilityServer
) -> None:
    target = f"127.0.0.1:{capability.port}"
    server = await orchestrator_with(shadow_routes(target, "topic-minilm", target))
    answers = await classify_texts(server, SHORT_TEXTS)

    await wait_until(lambda: compared(server) == len(SHORT_TEXTS), "every call compared")
    assert comparisons(server, "agree") == len(SHORT_TEXTS)
    assert comparisons(server, "disagree") == comparisons(server, "error") == 0
    differences = metric_sum(server.registry, f"{SHADOW_SCORE_DIFFERENCE}_count", route="default")
    assert differences == len(SHORT_TEXTS)
    # The callers' answers are the primary's, as without a shadow.
    assert [a.labels[0].name for a in answers] == await top_labels(
        capability, "topic-minilm", SHORT_TEXTS
    )
    assert {(a.model.name, a.fallback) for a in answers} == {("topic-minilm", False)}


async def test_shadow_of_a_different_model_counts_each_disagreement_and_logs_its_ids(
    orchestrator_with: StartOrchestrator,
    capability: CapabilityServer,
    start_capability: StartCapability,
) -> None:
    # Two capability servers: the session's for topic-minilm, one of its own for the shadow.
    shadow_server = await start_capability(models=("topic-static",))
    server = await orchestrator_with(
        shadow_routes(
            f"127.0.0.1:{capability.port}", "topic-static", f"127.0.0.1:{shadow_server.port}"
        )
    )
    primary = await top_labels(capability, "topic-minilm", SHORT_TEXTS)
    candidate = await top_labels(shadow_server, "topic-static", SHORT_TEXTS)
    differing = [i for i, (a, b) in enumerate(zip(primary, candidate, strict=True)) if a != b]
    assert 0 < len(differing) < len(SHORT_TEXTS), "the texts must show both outcomes"
    request_ids = [f"shadow-diff-{i}" for i in range(len(SHORT_TEXTS))]

    collector = LineCollector()  # the lines as the server writes them, IDs and all
    logger = logging.getLogger(shadow_module.__name__)
    logger.addHandler(collector)
    try:
        answers = await classify_texts(server, SHORT_TEXTS, request_ids)
        await wait_until(lambda: compared(server) == len(SHORT_TEXTS), "every call compared")
    finally:
        logger.removeHandler(collector)
    assert comparisons(server, "disagree") == len(differing)
    assert comparisons(server, "agree") == len(SHORT_TEXTS) - len(differing)
    assert [a.labels[0].name for a in answers] == primary  # never the shadow's answer
    # The primary call's request and trace IDs: the shadow runs in a context of its own.
    lines = [json.loads(line) for line in collector.lines]
    logged = {
        (line["request_id"], line["trace_id"])
        for line in lines
        if line["event"] == "shadow disagreement"
    }
    assert logged == {(request_ids[i], answers[i].trace_id) for i in differing}


async def test_failing_shadow_is_counted_and_changes_nothing_for_the_caller(
    orchestrator_with: StartOrchestrator,
    capability: CapabilityServer,
    span_exporter: InMemorySpanExporter,
) -> None:
    target = f"127.0.0.1:{capability.port}"
    server = await orchestrator_with(
        shadow_routes(target, "topic-minilm", f"127.0.0.1:{closed_port()}")
    )
    answers = await classify_texts(server, [STRIKER] * 6)

    await wait_until(lambda: comparisons(server, "error") == 6, "six failed shadow calls counted")
    assert comparisons(server, "agree") == comparisons(server, "disagree") == 0
    assert all(
        (a.labels[0].name, a.model.name, a.fallback, a.status)
        == ("sports", "topic-minilm", False, pb.RESULT_STATUS_DONE)
        for a in answers
    )
    registry = server.registry
    assert metric_sum(registry, f"{REQUEST_DURATION_SECONDS}_count", code="OK") == 6
    assert metric_sum(registry, MODEL_FALLBACK_TOTAL) == 0
    assert metric_sum(registry, UPSTREAM_RETRIES_TOTAL) == 0
    # The shadow call joins no caller's trace: one upstream_call per request.
    for answer in answers:
        calls = [
            span
            for span in span_exporter.get_finished_spans()
            if span.name == UPSTREAM_CALL and f"{span.context.trace_id:032x}" == answer.trace_id
        ]
        assert len(calls) == 1


async def test_a_failed_shadow_calls_log_lines_carry_the_requests_ids(
    orchestrator_with: StartOrchestrator, capability: CapabilityServer
) -> None:
    """A shadow call runs in a context of its own: its failure's line carried neither the
    request ID nor the trace ID, and could not be found by either."""
    target = f"127.0.0.1:{capability.port}"
    server = await orchestrator_with(
        shadow_routes(target, "topic-minilm", f"127.0.0.1:{closed_port()}")
    )
    collector = LineCollector()
    logger = logging.getLogger(upstream_errors.__name__)
    logger.addHandler(collector)
    try:
        (answer,) = await classify_texts(server, [STRIKER], ["shadowed-call"])
        await wait_until(lambda: comparisons(server, "error") == 1, "the failed shadow counted")
    finally:
        logger.removeHandler(collector)
    failed = [json.loads(line) for line in collector.lines]
    assert failed
    assert {(line["request_id"], line["trace_id"]) for line in failed} == {
        ("shadowed-call", answer.trace_id)
    }


async def test_percent_shadows_exactly_the_request_ids_in_its_share(
    orchestrator_with: StartOrchestrator, capability: CapabilityServer
) -> None:
    target = f"127.0.0.1:{capability.port}"
    server = await orchestrator_with(shadow_routes(target, "topic-minilm", target, percent="30"))
    request_ids = [f"share-{i}" for i in range(20)]
    expected = sum(1 for rid in request_ids if shadow_slot(rid) < 30)
    assert 0 < expected < len(request_ids)

    await classify_texts(server, [STRIKER] * len(request_ids), request_ids)

    await wait_until(lambda: compared(server) == expected, f"{expected} shadow calls compared")
    await asyncio.sleep(0.2)  # and no more arrive
    assert comparisons(server, "agree") == expected


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections and never answers: calls there hang until
    their deadline."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield int(listener.getsockname()[1])


@pytest_asyncio.fixture
async def capped_orchestrator(
    capability: CapabilityServer, silent_port: int, tmp_path: Path
) -> AsyncIterator[OrchestratorServer]:
    """At most one shadow call in flight, to a backend that never answers (5 s timeout:
    far longer than the four calls the test makes while it hangs)."""
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        shadow_routes(
            f"127.0.0.1:{capability.port}",
            "topic-minilm",
            f"127.0.0.1:{silent_port}",
            timeout="5s",
        )
    )
    server = OrchestratorServer(
        orchestrator_settings(routes_file=routes, shadow_max_in_flight=1),
        registry=CollectorRegistry(),
    )
    await server.start()
    yield server
    await server.stop(grace_seconds=0)


async def test_shadow_calls_past_the_cap_are_dropped_and_counted(
    capped_orchestrator: OrchestratorServer,
) -> None:
    server = capped_orchestrator
    answers = await classify_texts(server, [STRIKER] * 4)

    assert [a.labels[0].name for a in answers] == ["sports"] * 4
    # The first shadow call hangs; the three after it find the cap reached.
    assert metric_sum(server.registry, SHADOW_DROPPED_TOTAL, route="default") == 3
    await wait_until(lambda: comparisons(server, "error") == 1, "the hung shadow call timed out")
    # The slot frees in the task's done callback, one loop step after the count.
    await wait_until(lambda: server.dispatcher.shadow.in_flight == 0, "the shadow slot freed")


async def test_stopping_cancels_shadow_calls_in_flight_and_drains_the_routes_state(
    capability: CapabilityServer, silent_port: int, tmp_path: Path
) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        shadow_routes(f"127.0.0.1:{capability.port}", "topic-minilm", f"127.0.0.1:{silent_port}")
    )
    server = OrchestratorServer(
        orchestrator_settings(routes_file=routes), registry=CollectorRegistry()
    )
    await server.start()
    await classify_texts(server, [STRIKER] * 2)
    state = server.dispatcher.state
    assert server.dispatcher.shadow.in_flight == 2  # hung on the silent backend (5 s)
    assert state.in_flight == 2  # they hold the routes version's channels open

    await server.stop(grace_seconds=0)

    assert server.dispatcher.shadow.in_flight == 0
    assert state.in_flight == 0
    assert compared(server) == 0  # cancelled, neither compared nor counted as errors


# --- routes.yaml -------------------------------------------------------------------------

ROUTES = """version: 1
backends:
  minilm: {model: topic-minilm, targets: ["127.0.0.1:50052"]}
  static: {model: topic-static, targets: ["127.0.0.1:50052"]}
routes:
  - name: default
    backend: minilm
    shadow: {backend: static, percent: 10}
"""


def test_shadow_route_loads_and_explain_names_it(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(ROUTES)
    table = load_routes(path)
    shadow = table.default_route.shadow
    assert shadow is not None
    assert (shadow.backend.name, shadow.percent) == ("static", 10)
    assert table.default_route.backends == (table.backends["minilm"],)  # never a fallback
    facts = RequestFacts(text_chars=5, model="", priority="interactive", request_id="r", headers={})
    assert "shadow: static (model topic-static) also gets 10% of the answered calls" in explain(
        table, facts
    )


@pytest.mark.parametrize(
    ("new", "message"),
    [
        ("{backend: nope, percent: 10}", "routes[0].shadow.backend: unknown backend 'nope'"),
        ("{backend: minilm, percent: 10}", "routes[0].shadow.backend: backend 'minilm' is the"),
        ("{backend: static, percent: 0}", "routes[0].shadow.percent: 0 is outside 1..100"),
        ("{backend: static, percent: 101}", "routes[0].shadow.percent: 101 is outside 1..100"),
        ("{backend: static, percent: 5.5}", "routes[0].shadow.percent: 5.5 is not an integer"),
        ("{backend: static}", "routes[0].shadow: missing required key 'percent'"),
        ("{backend: static, percent: 5, colour: red}", "routes[0].shadow.colour: unknown key"),
        ("static", "routes[0].shadow: expected a mapping"),
    ],
)
def test_bad_shadow_is_refused_naming_its_path(tmp_path: Path, new: str, message: str) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(ROUTES.replace("{backend: static, percent: 10}", new))
    with pytest.raises(RoutesFileError) as caught:
        load_routes(path)
    assert message in str(caught.value)


def test_comparison_takes_top_labels_and_the_largest_shared_score_difference() -> None:
    same = compare((("sports", 0.9), ("world", 0.1)), (("sports", 0.7), ("world", 0.3)))
    assert same.agrees
    assert same.largest_difference == pytest.approx(0.2)
    differ = compare((("sports", 0.6),), (("world", 0.5),))
    assert not differ.agrees
    assert differ.largest_difference is None  # top_k=1 answers share no label


async def test_a_shadow_call_takes_no_slot_from_callers_of_the_shadow_backend(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """The shadow backend (max_concurrency 1) also serves a route of its own. While a
    shadow call waits there, a caller of that route is served by it, not refused for
    the slot the shadow call would hold and sent to its fallback."""
    stalled = FlakyPod(capability.port, failing=False)
    stalled.answering.clear()  # holds every call until set
    await stalled.start()
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        f"""version: 1
backends:
  static: {{model: topic-static, targets: ["127.0.0.1:{capability.port}"]}}
  candidate: {{model: topic-minilm, targets: ["{stalled.address}"], max_concurrency: 1}}
routes:
  - name: other
    match: {{header: {{name: x-route, values: [other]}}}}
    backend: candidate
    fallback: [static]
  - name: default
    backend: static
    shadow: {{backend: candidate, percent: 100}}
"""
    )
    server = OrchestratorServer(
        orchestrator_settings(routes_file=routes), registry=CollectorRegistry()
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=30)
            await wait_until(lambda: stalled.calls == 1, "the shadow call held")
            other = asyncio.ensure_future(
                stub.Classify(
                    pb.ClassifyRequest(text=STRIKER), metadata=(("x-route", "other"),), timeout=30
                )
            )
            await wait_until(lambda: stalled.calls == 2 or other.done(), "the caller sent")
            stalled.answering.set()
            answer = await other
    finally:
        await server.stop(grace_seconds=0)
        await stalled.stop()
    assert (answer.route, answer.fallback, answer.model.name) == ("other", False, "topic-minilm")
    assert metric_sum(server.registry, MODEL_FALLBACK_TOTAL) == 0


@pytest.mark.parametrize("budget", ["", "    budget: 20s\n"], ids=["no-budget", "budget"])
async def test_a_shadow_call_of_the_last_call_before_an_edit_keeps_its_channels(
    capability: CapabilityServer, orchestrator_with: StartOrchestrator, tmp_path: Path, budget: str
) -> None:
    """The edit (the shadow backend's timeout) is applied while one call is in flight on
    the routes before it. As that call left, its shadow call entered the same routes
    in the same turn of the loop; the old routes' close, already woken by the leave,
    closed the channels under the shadow call (an `error` comparison). On a route with
    a budget the work ran as a task of its own, and left turns before the shadow call
    entered."""
    target = f"127.0.0.1:{capability.port}"

    def routes(timeout: str) -> str:
        text = shadow_routes(target, "topic-minilm", target, timeout=timeout)
        return text.replace("    backend: minilm\n", "    backend: minilm\n" + budget)

    server = await orchestrator_with(routes("5s"))
    edited = tmp_path / "edited.yaml"
    edited.write_text(routes("4s"))
    await classify_texts(server, [STRIKER])  # connections up, and one comparison made
    await wait_until(lambda: compared(server) == 1, "the first comparison")
    before = server.dispatcher.state
    async with device_occupied(capability.pool.workers[0]):
        call = asyncio.ensure_future(classify_texts(server, [STRIKER]))
        await wait_until(lambda: before.in_flight > 0, "the call in flight")
        server._apply_routes(load_routes(edited))  # what the watcher does with an edit
    await call
    await wait_until(lambda: compared(server) == 2, "the second comparison")
    assert comparisons(server, "error") == 0
