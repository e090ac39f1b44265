"""Route matching of every kind, `explain`, `check`, and a header match through real servers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from orchestrator.routing import RequestFacts, RoutesFileError, RouteTable, load_routes
from orchestrator.routing.explain import explain
from orchestrator.routing.match import percent_slot
from orchestrator.server import OrchestratorServer
from tests.conftest import REPO_ROOT, orchestrator_settings

ROUTES = """version: 1
backends:
  minilm: {model: topic-minilm, targets: ["127.0.0.1:50052"]}
  static: {model: topic-static, targets: ["127.0.0.1:50052"]}
routes:
  - name: hinted
    match: {model: [topic-static, cheap]}
    backend: static
  - name: batch
    match: {priority: batch}
    backend: static
  - name: long
    match: {min_chars: 1000, max_chars: 100000}
    backend: static
  - name: tenant
    match: {header: {name: X-Tenant, values: [acme]}}
    backend: static
  - name: canary
    match: {percent: 10}
    backend: static
    fallback: [minilm]
  - name: default
    backend: minilm
    fallback: [static]
"""


def facts(**overrides: object) -> RequestFacts:
    values: dict[str, object] = {
        "text_chars": 20,
        "model": "",
        "priority": "interactive",
        "request_id": "fixed-id-1",
        "headers": {},
        **overrides,
    }
    return RequestFacts(**values)  # type: ignore[arg-type]


@pytest.fixture
def table(tmp_path: Path) -> RouteTable:
    path = tmp_path / "routes.yaml"
    path.write_text(ROUTES)
    return load_routes(path)


def not_canary(table: RouteTable) -> str:
    """A request ID outside the 10% canary share."""
    return next(
        f"id-{n}" for n in range(100) if table.select(facts(request_id=f"id-{n}")).name == "default"
    )


@pytest.mark.parametrize(
    ("overrides", "route"),
    [
        ({"model": "cheap"}, "hinted"),
        ({"model": "topic-minilm"}, "default"),
        ({"priority": "batch"}, "batch"),
        ({"text_chars": 1000}, "long"),
        ({"text_chars": 999}, "default"),
        ({"headers": {"x-tenant": "acme"}}, "tenant"),
        ({"headers": {"x-tenant": "other"}}, "default"),
    ],
)
def test_each_kind_of_match_selects_its_route(
    table: RouteTable, overrides: dict[str, object], route: str
) -> None:
    overrides.setdefault("request_id", not_canary(table))
    assert table.select(facts(**overrides)).name == route


def test_percent_split_takes_a_stable_share_of_request_ids(table: RouteTable) -> None:
    chosen = [table.select(facts(request_id=f"request-{n}")).name for n in range(2000)]
    share = chosen.count("canary") / len(chosen)
    assert 0.07 < share < 0.13
    # The same ID always lands on the same route, so a retry or poll follows it.
    assert all(table.select(facts(request_id=f"request-{n}")).name == chosen[n] for n in range(200))


CANARIES = """version: 1
backends:
  minilm: {model: topic-minilm, targets: ["127.0.0.1:50052"]}
  static: {model: topic-static, targets: ["127.0.0.1:50052"]}
routes:
  - name: canary-a
    match: {percent: 10}
    backend: static
  - name: tenant-canary
    match: {header: {name: x-tenant, values: [acme]}, percent: 50}
    backend: static
  - name: canary-b
    match: {percent: 20}
    backend: static
  - name: default
    backend: minilm
"""


def canaries(tmp_path: Path, text: str = CANARIES) -> RouteTable:
    path = tmp_path / "routes.yaml"
    path.write_text(text)
    return load_routes(path)


def test_each_percent_route_takes_its_own_slots_after_the_earlier_ones(tmp_path: Path) -> None:
    """10% then 20% once gave the second 10%: both compared the same slots from 0."""
    table = canaries(tmp_path)
    for n in range(2000):
        request_id = f"request-{n}"
        slot = percent_slot(request_id)
        plain = table.select(facts(request_id=request_id)).name
        tenant = table.select(facts(request_id=request_id, headers={"x-tenant": "acme"})).name
        # The tenant canary takes slots 10..59 whether or not a request meets its header.
        expected_plain = "canary-a" if slot < 10 else "canary-b" if 60 <= slot < 80 else "default"
        expected_tenant = "tenant-canary" if 10 <= slot < 60 else expected_plain
        assert (plain, tenant) == (expected_plain, expected_tenant), f"slot {slot}"


def test_percent_routes_get_the_shares_they_name(tmp_path: Path) -> None:
    table = canaries(tmp_path)
    names = [table.select(facts(request_id=f"share-{n}")).name for n in range(20000)]
    shares = {name: names.count(name) / len(names) for name in set(names)}
    assert set(shares) == {"canary-a", "canary-b", "default"}
    assert shares["canary-a"] == pytest.approx(0.10, abs=0.015)
    assert shares["canary-b"] == pytest.approx(0.20, abs=0.015)


def test_two_routes_of_the_same_percent_each_get_it(tmp_path: Path) -> None:
    """The second of two 10% routes once got nothing: its slots were all the first's."""
    table = canaries(tmp_path, CANARIES.replace("percent: 20", "percent: 10"))
    names = [table.select(facts(request_id=f"same-{n}")).name for n in range(20000)]
    assert names.count("canary-a") / len(names) == pytest.approx(0.10, abs=0.015)
    assert names.count("canary-b") / len(names) == pytest.approx(0.10, abs=0.015)


def test_percent_routes_taking_more_than_all_slots_are_refused_naming_the_one_over(
    tmp_path: Path,
) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(CANARIES.replace("percent: 20", "percent: 41"))
    with pytest.raises(RoutesFileError) as caught:
        load_routes(path)
    line = CANARIES.splitlines().index("    match: {percent: 20}") + 1
    assert str(caught.value) == (
        f"{path}:{line}: routes[2].match.percent: 41% does not fit: each percent route "
        "takes slots of its own, after those of the percent routes before it, and they "
        "have taken 60 of the 100, leaving 40"
    )
    # Exactly all of them is allowed.
    assert canaries(tmp_path, CANARIES.replace("percent: 20", "percent: 40"))


def test_explain_names_the_slots_of_a_percent_share(tmp_path: Path) -> None:
    table = canaries(tmp_path)
    request_id = next(f"id-{n}" for n in range(1000) if 60 <= percent_slot(f"id-{n}") < 80)
    slot = percent_slot(request_id)
    assert explain(table, facts(request_id=request_id)).splitlines()[:3] == [
        f"routes[0] canary-a: skipped, request ID's slot {slot} is outside the 10% share "
        "(slots 0..9)",
        "routes[1] tenant-canary: skipped, header x-tenant is None; request ID's slot "
        f"{slot} is outside the 50% share (slots 10..59)",
        "routes[2] canary-b: MATCHES (20% of request IDs, slots 60..79)",
    ]


def test_explain_names_the_route_why_others_were_skipped_and_the_backends(
    table: RouteTable,
) -> None:
    text = explain(table, facts(priority="batch", request_id=not_canary(table)))
    assert text.splitlines() == [
        "routes[0] hinted: skipped, model '(none)' not in ['cheap', 'topic-static']",
        "routes[1] batch: MATCHES (priority batch)",
        "backends tried in order (retry: up to 3 attempts each):",
        "  1. static (primary): model topic-static, timeout 5s, replicas 127.0.0.1:50052",
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            (
                "  - name: default\n    backend: minilm\n",
                "  - name: default\n    backend: minilm\n    match: {priority: batch}\n",
            ),
            "routes[5].match: the last route is the default and must match everything",
        ),
        (
            ("match: {priority: batch}", "match: {priority: urgent}"),
            "routes[1].match.priority: 'urgent' is not one of",
        ),
        (
            ("match: {percent: 10}", "match: {percent: 0}"),
            "routes[4].match.percent: 0 is not a whole percentage",
        ),
        (
            ("match: {min_chars: 1000, max_chars: 100000}", "match: {min_chars: 10, max_chars: 5}"),
            "routes[2].match: min_chars is greater than max_chars",
        ),
        (
            ("match: {priority: batch}", "match: {}"),
            "routes[1].match: an empty match matches everything",
        ),
        (
            ("match: {priority: batch}", "match: {model: [], priority: batch}"),
            "routes[1].match.model: an empty list names no model",
        ),
        (
            ("match: {min_chars: 1000, max_chars: 100000}", "match: {max_chars: 0}"),
            "routes[2].match.max_chars: 0 matches no text",
        ),
        (
            ("  - name: batch\n    match: {priority: batch}\n", "  - name: batch\n"),
            "routes[1]: matches everything; the routes after it are never used",
        ),
        (
            ("match: {percent: 10}", "match: {percent: 100}"),
            "routes[4]: matches everything; the routes after it are never used",
        ),
        (
            ("match: {priority: batch}", "match: {tenant: acme}"),
            "routes[1].match.tenant: unknown key",
        ),
    ],
)
def test_bad_match_is_refused_with_path_and_line(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    old, new = change
    assert old in ROUTES
    path = tmp_path / "routes.yaml"
    path.write_text(ROUTES.replace(old, new, 1))
    with pytest.raises(RoutesFileError) as caught:
        load_routes(path)
    assert message in str(caught.value)
    assert caught.value.line is not None
    assert str(caught.value).startswith(f"{path}:{caught.value.line}: ")


def test_check_command_passes_the_shipped_file_and_fails_a_broken_one(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(ROUTES.replace("fallback: [static]", "fallback: [bow]"))
    command = [sys.executable, "-m", "orchestrator.routing", "check"]
    good = subprocess.run([*command, "routes.yaml"], cwd=REPO_ROOT, capture_output=True, text=True)
    bad = subprocess.run([*command, str(broken)], cwd=REPO_ROOT, capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert good.stdout.startswith("routes.yaml: ok (")
    assert bad.returncode == 1
    line = broken.read_text().splitlines().index("    fallback: [bow]") + 1
    assert f"{broken}:{line}: routes[5].fallback[0]: unknown backend 'bow'" in bad.stderr


EXPLAIN = (sys.executable, "-m", "orchestrator.routing", "explain", "--routes", "routes.yaml")
EXPLAIN_REFUSES = "python -m orchestrator.routing explain: error: "


@pytest.mark.parametrize(
    ("argv", "refusal"),
    [
        (["--text", ""], "the server would refuse this request: --text: value is required"),
        (
            ["--text", " \u200b "],
            "the server would refuse this request: --text: must contain at least one "
            "non-whitespace character",
        ),
        (
            ["--text", "goal", "--model", "Topic Static"],
            "the server would refuse this request: --model: does not match regex pattern "
            "`^[a-z0-9]([a-z0-9._-]*[a-z0-9])?$`",
        ),
        (
            ["--text", "goal", "--request-id", "id with spaces"],
            "the server would refuse this request: --request-id: does not match regex pattern "
            "`^[A-Za-z0-9][A-Za-z0-9._:-]*$`",
        ),
        (
            ["--text", "goal", "--header", "x tenant=acme"],
            "--header 'x tenant=acme': a metadata key holds only letters, digits, '-', '_' and '.'",
        ),
    ],
    ids=["empty-text", "blank-text", "model", "request-id", "header"],
)
def test_explain_refuses_a_request_the_server_would_refuse(argv: list[str], refusal: str) -> None:
    """It explained where an empty text or a malformed model name would be routed,
    though the server refuses such a request before any route is chosen."""
    explained = subprocess.run(
        [*EXPLAIN, *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert explained.returncode == 2
    assert explained.stdout == ""
    assert explained.stderr.splitlines()[-1] == EXPLAIN_REFUSES + refusal


def test_explain_routes_a_request_the_server_takes() -> None:
    explained = subprocess.run(
        [*EXPLAIN, "--text", "goal", "--model", "topic-static", "--header", "X-Tenant=acme"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert explained.returncode == 0, explained.stderr
    assert "MATCHES" in explained.stdout


async def test_tenant_header_routes_to_its_backend_through_real_servers(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(
        ROUTES.replace("50052", str(capability.port)).replace("percent: 10", "percent: 1")
    )
    server = OrchestratorServer(
        orchestrator_settings(port=0, metrics_port=-1, routes_file=path, routes_poll_seconds=0),
        registry=CollectorRegistry(),
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            request = pb.ClassifyRequest(
                text="The striker scored twice in the final minutes of the cup match",
                request_id=not_canary(server.routes),
            )
            tenant = await stub.Classify(request, metadata=(("x-tenant", "acme"),))
            plain = await stub.Classify(request)
    finally:
        await server.stop(grace_seconds=0)
    assert (tenant.route, tenant.model.name) == ("tenant", "topic-static")
    assert (plain.route, plain.model.name) == ("default", "topic-minilm")
