"""Who may call: API keys, the capability servers' internal token, per-tenant rate limits."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.rpc.error_details_pb2 import ErrorInfo, RetryInfo
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc, model_service_pb2_grpc
from ai.classify.v1 import model_service_pb2 as model_pb
from capability.metrics import MODEL_TEXTS_TOTAL
from capability.metrics import RELOADS_TOTAL as MODEL_RELOADS_TOTAL
from capability.server import CapabilityServer
from classify_common import interceptor
from classify_common.errors import RateLimited
from classify_common.metrics import INTERNAL_ERRORS_TOTAL, RPC_REQUESTS_TOTAL
from classify_common.settings import SettingsError
from orchestrator.metrics import (
    API_KEYS_FILE_REFUSED,
    API_KEYS_RELOADS_TOTAL,
    AUTH_FAILURES_TOTAL,
    RATE_LIMITED_TOTAL,
    OrchestratorMetrics,
)
from orchestrator.security import KeysFileError, hash_key, load_api_keys, new_key
from orchestrator.security.gate import CallerGate
from orchestrator.security.limits import TenantRateLimits, TokenBucketSettings
from orchestrator.server import OrchestratorServer
from orchestrator.upstream import errors as upstream_errors
from tests.conftest import (
    STRIKER,
    LineCollector,
    StartCapability,
    closed_port,
    metric_sum,
    orchestrator_settings,
    wait_until,
    write_routes,
)
from tests.hostile_files import OVERSIZE_YAML_COMMENT, TOO_DEEP_YAML, nested_aliases
from tests.status_details import error_info, error_reason, refusal, trailers_of, unpack

ACME_KEY, OTHER_KEY, ADMIN_KEY = new_key(), new_key(), new_key()
TOKEN = "internal-token-for-tests"
# A YAML int past a float's range.
PAST_FLOAT = "1" + "0" * 400
Start = Callable[..., Awaitable[tuple[OrchestratorServer, CapabilityServer]]]


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def keys_file(tenants: str = "", acme_tenant: str = "acme", acme_key: str = ACME_KEY) -> str:
    return (
        "keys:\n"
        f"  - {{id: a, sha256: {hash_key(acme_key)}, tenant: {acme_tenant}, role: user}}\n"
        f"  - {{id: b, sha256: {hash_key(OTHER_KEY)}, tenant: other, role: user}}\n"
        f"  - {{id: ops, sha256: {hash_key(ADMIN_KEY)}, tenant: ops, role: admin}}\n" + tenants
    )


def replace_keys(path: Path, text: str) -> None:
    """Written beside and renamed over, as a ConfigMap or Secret update swaps it."""
    staging = path.with_name(path.name + ".new")
    staging.write_text(text)
    staging.replace(path)


@pytest_asyncio.fixture
async def secured(start_capability: StartCapability, tmp_path: Path) -> AsyncIterator[Start]:
    """A capability server requiring the internal token, behind an orchestrator with keys."""
    started: list[Any] = []

    async def start(
        tenants: str = "",
        acme_tenant: str = "acme",
        dead_replica: bool = False,
        orchestrator_token: str = TOKEN,
        model_root: Path | None = None,
        keys_poll_seconds: float = 1.0,
    ) -> tuple[OrchestratorServer, CapabilityServer]:
        """`dead_replica`: the backend lists, first, an address nothing listens on.
        `orchestrator_token`: the internal token the orchestrator sends. `model_root`:
        the capability's, instead of the session's. The keys file is tmp_path/keys.yaml."""
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        sent_token_file = tmp_path / "sent-token"
        sent_token_file.write_text(orchestrator_token + "\n")
        capability = await start_capability(
            models=("topic-static",),
            internal_token_file=token_file,
            **({"model_root": model_root} if model_root else {}),
        )
        keys = tmp_path / "keys.yaml"
        keys.write_text(keys_file(tenants, acme_tenant))
        targets = [f"127.0.0.1:{capability.port}"]
        if dead_replica:
            targets.insert(0, f"127.0.0.1:{closed_port()}")
        routes = tmp_path / "routes.yaml"
        routes.write_text(
            f"""version: 1
backends:
  static: {{model: topic-static, targets: {json.dumps(targets)}}}
routes:
  - name: acme-only
    match: {{header: {{name: x-tenant, values: [acme]}}}}
    backend: static
  - name: default
    backend: static
"""
        )
        orchestrator = OrchestratorServer(
            orchestrator_settings(
                routes_file=routes,
                auth="required",
                api_keys_file=keys,
                keys_poll_seconds=keys_poll_seconds,
                internal_token_file=sent_token_file,
            ),
            registry=CollectorRegistry(),
        )
        started.append(orchestrator)
        await orchestrator.start()
        return orchestrator, capability

    yield start
    for server in reversed(started):
        await server.stop(grace_seconds=0)


async def call(server: Any, **kwargs: Any) -> pb.ClassifyResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        response: pb.ClassifyResponse = await stub.Classify(
            pb.ClassifyRequest(text=STRIKER), **kwargs
        )
        return response


@pytest.mark.parametrize(
    ("metadata", "cause"),
    [
        ((), "missing_key"),
        (bearer("ck_not-a-key"), "unknown_key"),
        ((("authorization", ACME_KEY),), "missing_key"),
        (bearer("ck_not-a-key") + bearer(ACME_KEY), "repeated_key"),
        (bearer(ACME_KEY) + bearer(ACME_KEY), "repeated_key"),
        ((("authorization", "Bearer   "),), "missing_key"),
    ],
    ids=["no-key", "wrong-key", "not-bearer", "wrong-then-valid", "valid-twice", "empty-key"],
)
async def test_missing_or_wrong_key_is_refused_before_any_model(
    secured: Start, metadata: tuple[tuple[str, str], ...], cause: str
) -> None:
    orchestrator, capability = await secured()
    error = await refusal(call(orchestrator, metadata=metadata))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_reason(error) == "UNAUTHENTICATED"
    assert metric_sum(capability.registry, MODEL_TEXTS_TOTAL) == 0
    assert metric_sum(orchestrator.registry, AUTH_FAILURES_TOTAL) == 1
    assert metric_sum(orchestrator.registry, AUTH_FAILURES_TOTAL, reason=cause) == 1
    # A valid key goes through, and the orchestrator's token gets it past the capability.
    assert (await call(orchestrator, metadata=bearer(ACME_KEY))).labels[0].name == "sports"


async def test_every_auth_failure_cause_is_exported_at_zero_before_any_refusal(
    secured: Start,
) -> None:
    """A series made at its first refusal appears at 1, where a panel's rate() (or an
    alert's increase()) sees no increase: every cause the gate refuses for is there,
    at 0, from the start."""
    orchestrator, _ = await secured()
    exported = {
        sample.labels["reason"]: sample.value
        for family in orchestrator.registry.collect()
        for sample in family.samples
        if sample.name == AUTH_FAILURES_TOTAL
    }
    assert exported == {"missing_key": 0, "repeated_key": 0, "unknown_key": 0}


async def test_capability_refuses_callers_without_the_internal_token(secured: Start) -> None:
    _, capability = await secured()
    sent_twice = (("x-internal-token", "guess"), ("x-internal-token", TOKEN))
    for metadata in ((), (("x-internal-token", "guess"),), sent_twice):
        error = await refusal(call(capability, metadata=metadata))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert metric_sum(capability.registry, MODEL_TEXTS_TOTAL) == 0
    # Probes still work without it.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        health: Any = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_wrong_internal_token_is_answered_internal_counted_and_logged_saying_so(
    secured: Start,
) -> None:
    """The capability refuses the orchestrator's token: UNAUTHENTICATED, which no
    capability answers an orchestrator set up right. Callers get INTERNAL with their
    IDs; each answer is counted where the ClassifyInternalErrors alert looks, and
    logged at ERROR under its IDs, naming the backend, the code and the cause."""
    orchestrator, _ = await secured(orchestrator_token="not-the-token")
    collector = LineCollector()
    upstream_log = logging.getLogger(upstream_errors.__name__)
    upstream_log.addHandler(collector)
    try:
        error = await refusal(call(orchestrator, metadata=bearer(ACME_KEY), timeout=10))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            batch = await stub.ClassifyBatch(
                pb.ClassifyBatchRequest(items=[pb.ClassifyRequest(text=STRIKER)] * 2),
                metadata=bearer(ACME_KEY),
                timeout=10,
            )
    finally:
        upstream_log.removeHandler(collector)

    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == "backend static failed with UNAUTHENTICATED"
    assert {result.error.code for result in batch.results} == {grpc.StatusCode.INTERNAL.value[0]}
    assert metric_sum(orchestrator.registry, INTERNAL_ERRORS_TOTAL) == 3
    await wait_until(
        lambda: metric_sum(orchestrator.registry, RPC_REQUESTS_TOTAL, code="INTERNAL") == 1,
        "the call counted",
    )
    lines = [json.loads(line) for line in collector.lines]
    assert [line["level"] for line in lines] == ["error"] * 3
    item_ids = [unpack(result.error, ErrorInfo)[0].metadata for result in batch.results]
    assert [(line["request_id"], line["trace_id"]) for line in lines] == [
        (trailers_of(error)["x-request-id"], trailers_of(error)["x-trace-id"]),
        *((ids["x-request-id"], ids["x-trace-id"]) for ids in item_ids),
    ]
    for line in lines:
        assert line["event"] == "capability call failed unexpectedly"
        assert (line["backend"], line["code"]) == ("static", "UNAUTHENTICATED")
        assert line["cause"] == (
            "the capability server refused this orchestrator's internal token: "
            "the two --internal-token-file files do not hold the same token"
        )


async def test_each_tenant_has_its_own_rate_limit(secured: Start) -> None:
    orchestrator, _ = await secured("tenants:\n  acme: {rate_per_second: 0.01, burst: 2}\n")
    for _ in range(2):
        await call(orchestrator, metadata=bearer(ACME_KEY))
    error = await refusal(call(orchestrator, metadata=bearer(ACME_KEY)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_reason(error) == "RATE_LIMITED"
    assert error_info(error).metadata["tenant"] == "acme"
    for _ in range(3):  # another tenant is not held back
        await call(orchestrator, metadata=bearer(OTHER_KEY))
    assert metric_sum(orchestrator.registry, RATE_LIMITED_TOTAL, tenant="acme") == 1
    assert metric_sum(orchestrator.registry, RATE_LIMITED_TOTAL) == 1


async def test_a_key_revoked_or_added_in_the_keys_file_holds_without_a_restart(
    secured: Start, tmp_path: Path
) -> None:
    orchestrator, _ = await secured(keys_poll_seconds=0.05)
    await call(orchestrator, metadata=bearer(ACME_KEY))
    replacement = new_key()
    replace_keys(tmp_path / "keys.yaml", keys_file(acme_key=replacement))
    await wait_until(
        lambda: metric_sum(orchestrator.registry, API_KEYS_RELOADS_TOTAL, outcome="ok") == 1,
        "the edit applied",
    )
    revoked = await refusal(call(orchestrator, metadata=bearer(ACME_KEY)))
    assert revoked.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_info(revoked).metadata["cause"] == "unknown_key"
    answer = await call(orchestrator, metadata=bearer(replacement))
    assert answer.status == pb.RESULT_STATUS_DONE
    await call(orchestrator, metadata=bearer(OTHER_KEY))  # a key the edit kept
    assert metric_sum(orchestrator.registry, API_KEYS_RELOADS_TOTAL, outcome="failed") == 0


async def test_a_refused_keys_edit_keeps_the_keys_in_force_and_says_so_until_fixed(
    secured: Start, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    orchestrator, _ = await secured(keys_poll_seconds=0.05)
    keys = tmp_path / "keys.yaml"
    doubled = keys_file() + f"  - {{id: a, sha256: {hash_key(new_key())}, tenant: x, role: user}}\n"
    with caplog.at_level(logging.ERROR):
        replace_keys(keys, doubled)
        await wait_until(
            lambda: (
                metric_sum(orchestrator.registry, API_KEYS_RELOADS_TOTAL, outcome="failed") == 1
            ),
            "the edit refused",
        )
    assert metric_sum(orchestrator.registry, API_KEYS_FILE_REFUSED) == 1
    [logged] = [r for r in caplog.records if r.getMessage().startswith("API keys file refused")]
    assert logged.getMessage() == "API keys file refused; the keys in force stay"
    assert "keys[3].id: the same id as keys[0]" in logged.__dict__["error"]
    await call(orchestrator, metadata=bearer(ACME_KEY))  # the keys in force stay
    replace_keys(keys, keys_file())
    await wait_until(
        lambda: metric_sum(orchestrator.registry, API_KEYS_RELOADS_TOTAL, outcome="ok") == 1,
        "the fixed file applied",
    )
    assert metric_sum(orchestrator.registry, API_KEYS_FILE_REFUSED) == 0


async def test_a_tenants_limit_edited_in_the_keys_file_holds_without_a_restart(
    secured: Start, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.yaml"
    orchestrator, _ = await secured(
        "tenants:\n  acme: {rate_per_second: 0.01, burst: 2}\n", keys_poll_seconds=0.05
    )

    async def edit(tenants: str, applied: int) -> None:
        replace_keys(keys, keys_file(tenants))
        await wait_until(
            lambda: (
                metric_sum(orchestrator.registry, API_KEYS_RELOADS_TOTAL, outcome="ok") == applied
            ),
            "the edit applied",
        )

    for _ in range(2):
        await call(orchestrator, metadata=bearer(ACME_KEY))
    # A higher limit grants no fresh burst to a tenant that has just spent its own.
    await edit("tenants:\n  acme: {rate_per_second: 0.01, burst: 5}\n", applied=1)
    assert error_reason(await refusal(call(orchestrator, metadata=bearer(ACME_KEY)))) == (
        "RATE_LIMITED"
    )
    # A tenant given a limit starts with a full bucket; one left out is no longer limited.
    await edit("tenants:\n  other: {rate_per_second: 0.01, burst: 1}\n", applied=2)
    for _ in range(3):
        await call(orchestrator, metadata=bearer(ACME_KEY))
    await call(orchestrator, metadata=bearer(OTHER_KEY))
    other = await refusal(call(orchestrator, metadata=bearer(OTHER_KEY)))
    assert error_info(other).metadata["tenant"] == "other"
    assert metric_sum(orchestrator.registry, RATE_LIMITED_TOTAL) == 2


class _RefusingLimits(TenantRateLimits):
    def set_limits(self, limits: Mapping[str, TokenBucketSettings]) -> None:
        raise RuntimeError("the limits of the edit cannot be set")


def test_a_keys_edit_whose_limits_cannot_be_set_leaves_the_keys_in_force(
    tmp_path: Path,
) -> None:
    """replace_keys swapped the keys, then failed setting the limits: the edit's keys
    were in force with the limits before it, while the watcher reported it refused."""
    before = tmp_path / "before.yaml"
    before.write_text(keys_file())
    edited = tmp_path / "edited.yaml"
    edited_key = new_key()
    edited.write_text(keys_file(acme_key=edited_key))
    in_force = load_api_keys(before)
    gate = CallerGate(
        in_force,
        OrchestratorMetrics(CollectorRegistry()),
        limits=_RefusingLimits(in_force.tenant_limits),
    )
    with pytest.raises(RuntimeError):
        gate.replace_keys(load_api_keys(edited))
    assert gate.identifies({"authorization": f"Bearer {ACME_KEY}"})
    assert not gate.identifies({"authorization": f"Bearer {edited_key}"})


def test_an_edited_limit_keeps_what_the_bucket_held_up_to_the_new_burst() -> None:
    now = [1000.0]
    limits = TenantRateLimits(
        {"acme": TokenBucketSettings(1, 10), "same": TokenBucketSettings(1, 10)},
        clock=lambda: now[0],
    )
    assert limits.take("acme", 4)[1] == 4
    assert limits.take("same", 4)[1] == 4
    now[0] += 1  # one token back each: 7 held
    limits.set_limits(
        {
            "acme": TokenBucketSettings(1, 3),  # lowered below what it held
            "same": TokenBucketSettings(1, 10),
            "new": TokenBucketSettings(1, 2),
        }
    )
    assert limits.take("acme", 10)[1] == 3
    assert limits.take("same", 10)[1] == 7  # its bucket, as it was
    assert limits.take("new", 10)[1] == 2  # full
    limits.set_limits({})
    assert limits.take("acme", 100)[1] == 100  # no longer limited


def test_a_caller_that_waits_out_the_rate_limit_hint_as_sent_gets_its_token() -> None:
    """The hint is the time to the next token; cut to the nanosecond it fell a fraction
    short, and a client that waited exactly that long was refused again."""
    now = [1000.0]
    limits = TenantRateLimits({"acme": TokenBucketSettings(3, 1)}, clock=lambda: now[0])
    assert limits.take("acme")[1] == 1
    _, granted, wait = limits.take("acme")
    assert granted == 0
    refusal = RateLimited("over its rate", retry_after_seconds=wait, tenant="acme")
    (retry,) = [detail for detail in refusal.details() if isinstance(detail, RetryInfo)]
    # As a Python client reads it (timedelta: to the microsecond) and waits it out.
    now[0] += retry.retry_delay.ToTimedelta().total_seconds()
    assert limits.take("acme")[1] == 1


def test_a_batch_refused_in_part_is_hinted_the_wait_for_all_its_refused_items() -> None:
    """Up to the burst: a hint to the next token served one of the refused items sent
    again and refused the rest again, however long the caller's deadline."""
    now = [1000.0]
    limits = TenantRateLimits({"acme": TokenBucketSettings(2, 10)}, clock=lambda: now[0])
    _, granted, wait = limits.take("acme", 14)
    assert (granted, wait) == (10, 2.0)  # 4 tokens at 2 a second
    now[0] += wait
    assert limits.take("acme", 4)[1] == 4
    _, granted, wait = limits.take("acme", 30)
    assert (granted, wait) == (0, 5.0)  # a burst's worth, not 30
    now[0] += wait
    assert limits.take("acme", 30)[1] == 10


async def test_a_default_limit_gives_each_unlisted_tenant_a_bucket_of_its_own(
    secured: Start,
) -> None:
    """Without it, a tenant the file does not list is not limited at all: one new
    team's load test could take the whole service."""
    orchestrator, _ = await secured(
        "tenants:\n  acme: {rate_per_second: 0.01, burst: 4}\n"
        "default_tenant_limit: {rate_per_second: 0.01, burst: 2}\n"
    )
    for _ in range(2):
        await call(orchestrator, metadata=bearer(OTHER_KEY))
        await call(orchestrator, metadata=bearer(ADMIN_KEY))
    other = await refusal(call(orchestrator, metadata=bearer(OTHER_KEY)))
    admin = await refusal(call(orchestrator, metadata=bearer(ADMIN_KEY)))
    for _ in range(4):  # a listed tenant keeps its own limit
        await call(orchestrator, metadata=bearer(ACME_KEY))
    assert (error_reason(other), error_info(other).metadata["tenant"]) == ("RATE_LIMITED", "other")
    assert (error_reason(admin), error_info(admin).metadata["tenant"]) == ("RATE_LIMITED", "ops")
    assert metric_sum(orchestrator.registry, RATE_LIMITED_TOTAL) == 2


async def test_routes_see_the_authenticated_tenant_not_a_claimed_one(secured: Start) -> None:
    orchestrator, _ = await secured()
    spoofed = await call(orchestrator, metadata=(*bearer(OTHER_KEY), ("x-tenant", "acme")))
    genuine = await call(orchestrator, metadata=bearer(ACME_KEY))
    assert (spoofed.route, genuine.route) == ("default", "acme-only")


async def test_bytes_that_are_no_message_are_refused_for_the_key_and_rate_first(
    secured: Start,
) -> None:
    """Such bytes were INVALID_ARGUMENT without any key (no auth failure counted), and
    for a tenant over its rate; the key and the rate are checked before validation."""
    orchestrator, _ = await secured(
        tenants="tenants:\n  acme: {rate_per_second: 0.001, burst: 1}\n"
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        raw: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/ai.classify.v1.ClassifyService/Classify"
        )
        junk = b"\xff\xff\xff"
        no_key = await refusal(raw(junk, timeout=10))
        with_key = await refusal(raw(junk, metadata=bearer(ACME_KEY), timeout=10))
        over_rate = await refusal(raw(junk, metadata=bearer(ACME_KEY), timeout=10))
    assert no_key.code() == grpc.StatusCode.UNAUTHENTICATED
    assert metric_sum(orchestrator.registry, AUTH_FAILURES_TOTAL, reason="missing_key") == 1
    assert with_key.code() == grpc.StatusCode.INVALID_ARGUMENT  # took the one token
    assert over_rate.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert metric_sum(orchestrator.registry, RATE_LIMITED_TOTAL, tenant="acme") == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keys:\n  - {id: a, sha256: abc, tenant: t, role: user}\n", "keys[0].sha256: not 64"),
        (
            f"keys:\n  - {{id: a, sha256: {'a' * 64}, tenant: t, role: root}}\n",
            "keys[0].role: 'root'",
        ),
        (
            f"keys:\n  - {{id: a, sha256: {'a' * 64}, tenant: t, role: user}}\n"
            "tenants:\n  t: {rate_per_second: 0, burst: 1}\n",
            "tenants.t: rate_per_second 0",
        ),
        ("users: []\n", "expected a mapping with `keys`"),
        (
            f"keys:\n  - {{id: a, sha256: {'a' * 64}, tenant: on, role: user}}\n",
            "keys[0].tenant: YAML reads a tenant name as the bool True",
        ),
        # Unquoted, 00123 (an octal) and 83 were both the int 83, and so one tenant:
        # each read the other's results and shared its rate.
        (
            f"keys:\n  - {{id: a, sha256: {'a' * 64}, tenant: 00123, role: user}}\n",
            "keys[0].tenant: YAML reads a tenant name as the int 83, not a string; quote it",
        ),
        (
            f"keys:\n  - {{id: a, sha256: {'a' * 64}, tenant: 0x10, role: user}}\n",
            "keys[0].tenant: YAML reads a tenant name as the int 16",
        ),
        (
            f"keys:\n  - {{id: a, sha256: {'b' * 64}, tenant: t, role: user}}\n"
            f"  - {{id: c, sha256: {'c' * 64}, tenant: t, role: user}}\n"
            f"  - {{id: d, sha256: {'b' * 64}, tenant: u, role: admin}}\n",
            "keys[2].sha256: the same key as keys[0]",
        ),
        # Logs and refusals name a caller by its key's id: which key made the call?
        (
            f"keys:\n  - {{id: ci, sha256: {'b' * 64}, tenant: t, role: user}}\n"
            f"  - {{id: ci, sha256: {'c' * 64}, tenant: u, role: admin}}\n",
            "keys[1].id: the same id as keys[0]",
        ),
        # The hash of "" (a template's empty key variable): `Bearer ` would get in.
        (
            "keys:\n  - {id: a, sha256: "
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855, "
            "tenant: t, role: admin}\n",
            "keys[0].sha256: the hash of an empty key",
        ),
    ],
)
def test_bad_keys_file_is_refused_naming_the_entry(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(KeysFileError, match=re.escape(message)):
        load_api_keys(path)


def test_a_limit_for_a_tenant_no_key_names_loads_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A misspelt name leaves the tenant meant without a limit: said at load. Not
    refused: a tenant whose last key was revoked keeps its line, and a refused file
    would stop every orchestrator that restarts."""
    path = tmp_path / "keys.yaml"
    path.write_text(
        f"keys:\n  - {{id: a, sha256: {'a' * 64}, tenant: acme, role: user}}\n"
        "tenants:\n  acmee: {rate_per_second: 1, burst: 1}\n"
    )
    with caplog.at_level(logging.WARNING, logger="orchestrator.security.keys"):
        keys = load_api_keys(path)
    assert list(keys.tenant_limits) == ["acmee"]
    (warning,) = caplog.records
    assert warning.getMessage() == "a tenant limit names no key's tenant; is it misspelt?"
    assert warning.__dict__["tenant"] == "acmee"


@pytest.mark.parametrize(
    "tenant", ["00123", "83", "on", "1:30", "a: b", 'say "hi"', "caf\u00e9 \U0001f600"]
)
def test_the_entry_new_key_prints_names_the_tenant_as_given(tmp_path: Path, tenant: str) -> None:
    """`new-key` printed the tenant unquoted, and YAML read `00123` as 83; the key's id
    too (`on` became 'True', `#laptop` None, `a: b` broke the file)."""
    printed = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.security",
            "new-key",
            "--id",
            tenant,
            "--tenant",
            tenant,
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    key = printed.splitlines()[0].rsplit(" ", 1)[1]
    entry = printed.split("\n", 2)[2]  # after the key line and the entry's heading
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n" + entry)
    caller = load_api_keys(path).identify(key)
    assert caller is not None
    assert (caller.key_id, caller.tenant) == (tenant, tenant)


def test_each_of_many_keys_is_told_apart_by_its_hash(tmp_path: Path) -> None:
    keys = [new_key() for _ in range(500)]
    path = tmp_path / "keys.yaml"
    path.write_text(
        "keys:\n"
        + "".join(
            f"  - {{id: k{i}, sha256: {hash_key(key)}, tenant: t{i % 7}, role: user}}\n"
            for i, key in enumerate(keys)
        )
    )
    loaded = load_api_keys(path)
    for i in (0, 1, 250, 499):
        caller = loaded.identify(keys[i])
        assert caller is not None
        assert (caller.key_id, caller.tenant) == (f"k{i}", f"t{i % 7}")
    assert loaded.identify(new_key()) is None
    assert loaded.identify(keys[3][:-1]) is None
    assert loaded.identify("") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keys: []\n" + nested_aliases(), r"^{path}:2:5: anchor &l0: YAML anchors and aliases"),
        ("keys: []\n" + TOO_DEEP_YAML, r"^{path}:2:\d+: mappings and lists nest deeper than 32"),
        ("keys: []\n" + OVERSIZE_YAML_COMMENT, r"^{path}: \d+ bytes, over the 262144-byte limit"),
    ],
)
def test_keys_file_past_the_reading_bounds_is_refused(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(KeysFileError, match=message.format(path=re.escape(str(path)))):
        load_api_keys(path)


async def test_reload_through_the_orchestrator_needs_the_admin_role(secured: Start) -> None:
    orchestrator, capability = await secured()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        listed = await models.ListModels(model_pb.ListModelsRequest(), metadata=bearer(ACME_KEY))
        assert [m.name for m in listed.models] == ["topic-static"]
        reload = model_pb.ReloadModelRequest(name="topic-static")
        error = await refusal(models.ReloadModel(reload, metadata=bearer(ACME_KEY)))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error_reason(error) == "PERMISSION_DENIED"
        reloaded = await models.ReloadModel(reload, metadata=bearer(ADMIN_KEY))
    assert (reloaded.model.name, reloaded.previous_version) == ("topic-static", "1")
    assert metric_sum(capability.registry, MODEL_RELOADS_TOTAL, outcome="ok") == 1


async def test_a_fleet_reload_a_replica_missed_says_how_many_took_it(secured: Start) -> None:
    """Two replicas, the first down: GetModel is answered by the other, a reload is
    taken by it and answered UNAVAILABLE (a retry is safe) naming what was missed."""
    orchestrator, capability = await secured(dead_replica=True)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        described = await models.GetModel(
            model_pb.GetModelRequest(name="topic-static"), metadata=bearer(ACME_KEY)
        )
        reload = model_pb.ReloadModelRequest(name="topic-static")
        missed = await refusal(models.ReloadModel(reload, metadata=bearer(ADMIN_KEY)))
        missing_version = model_pb.ReloadModelRequest(name="topic-static", version="9")
        refused = await refusal(models.ReloadModel(missing_version, metadata=bearer(ADMIN_KEY)))
    assert described.model.version == "1"
    assert missed.code() == grpc.StatusCode.UNAVAILABLE
    assert missed.details() == (
        "1 of 2 replicas reloaded topic-static; static: did not answer (UNAVAILABLE)"
    )
    assert metric_sum(capability.registry, MODEL_RELOADS_TOTAL, outcome="ok") == 1
    # The live replica refused (no such version) and the other did not answer.
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (refused.details() or "").startswith(
        "0 of 2 replicas reloaded topic-static; static: did"
    )


async def test_a_fleet_reload_of_a_version_no_replica_has_is_not_found(
    secured: Start, caplog: pytest.LogCaptureFixture
) -> None:
    orchestrator, capability = await secured()
    with caplog.at_level(logging.WARNING, logger="orchestrator.upstream.errors"):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            models = model_service_pb2_grpc.ModelServiceStub(channel)
            missing_version = model_pb.ReloadModelRequest(name="topic-static", version="9")
            refused = await refusal(models.ReloadModel(missing_version, metadata=bearer(ADMIN_KEY)))
    # The operator's NOT_FOUND, not a classify call's replica without its model: no
    # ERROR line sending the on-call to routes.yaml.
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert refused.code() == grpc.StatusCode.NOT_FOUND
    assert (refused.details() or "").startswith("0 of 1 replicas reloaded topic-static; static: ")
    assert metric_sum(capability.registry, MODEL_RELOADS_TOTAL, outcome="ok") == 0


async def test_only_an_admin_is_told_where_a_model_was_loaded_from(secured: Start) -> None:
    orchestrator, _ = await secured()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        request = model_pb.GetModelRequest(name="topic-static")
        user = await models.GetModel(request, metadata=bearer(ACME_KEY))
        admin = await models.GetModel(request, metadata=bearer(ADMIN_KEY))
        (listed,) = (
            await models.ListModels(model_pb.ListModelsRequest(), metadata=bearer(ACME_KEY))
        ).models
    assert admin.model.source.endswith("topic-static/1")
    assert admin.model.memory
    assert (user.model.source, list(user.model.memory)) == ("", [])
    assert (listed.source, list(listed.memory)) == ("", [])
    assert user.model.digest == admin.model.digest
    assert user.model.version == admin.model.version == "1"


async def test_only_an_admin_is_told_of_refused_versions(
    secured: Start, model_root: Path, tmp_path: Path
) -> None:
    """A refused version's reason can name server paths (a folder linked from outside
    the root): an admin's GetModel carries it, a user's leaves the list out."""
    root = tmp_path / "models"
    shutil.copytree(model_root / "topic-static" / "1", root / "topic-static" / "1")
    shutil.copytree(model_root / "topic-static" / "1", root / "topic-static" / "2")
    (root / "topic-static" / "2" / "head.safetensors").write_bytes(b"not the weights")
    orchestrator, _ = await secured(model_root=root)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        request = model_pb.GetModelRequest(name="topic-static")
        user = await models.GetModel(request, metadata=bearer(ACME_KEY))
        admin = await models.GetModel(request, metadata=bearer(ADMIN_KEY))
    assert admin.model.version == user.model.version == "1"
    [refused] = admin.model.refused_versions
    assert refused.version == "2"
    assert refused.reason.startswith("head.safetensors: 15 bytes, but manifest.json records")
    assert list(user.model.refused_versions) == []


async def test_an_operator_call_through_the_orchestrator_is_one_trace_in_both_processes(
    secured: Start, span_exporter: InMemorySpanExporter
) -> None:
    orchestrator, _ = await secured()
    span_exporter.clear()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        await models.GetModel(
            model_pb.GetModelRequest(name="topic-static"), metadata=bearer(ACME_KEY)
        )

    def servers() -> list[ReadableSpan]:
        return [
            span
            for span in span_exporter.get_finished_spans()
            if span.name == "ai.classify.v1.ModelService/GetModel" and span.kind == SpanKind.SERVER
        ]

    # The orchestrator's and the capability's server spans (each ends as its answer
    # has gone), in one trace.
    await wait_until(lambda: len(servers()) == 2, "both server spans")
    assert len({span.context.trace_id for span in servers() if span.context is not None}) == 1


async def test_a_large_message_is_not_parsed_for_a_caller_the_gate_refuses(
    secured: Start, span_exporter: InMemorySpanExporter
) -> None:
    """40,000 empty items (80 KB): without a key (or, at the capability, the token) the
    message is never parsed (an 8 MiB one held the event loop 0.4 s), and the call is
    refused for its credentials as any call is. With a key it is read, and refused for
    its item count."""
    orchestrator, capability = await secured()
    flood = b"\x0a\x00" * 40_000
    batch_method = "/ai.classify.v1.ClassifyService/ClassifyBatch"
    span_exporter.clear()
    refused = []
    for server, metadata in (
        (orchestrator, ()),
        (capability, ()),
        (orchestrator, bearer(ACME_KEY)),
    ):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            raw: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(batch_method)
            refused.append(await refusal(raw(flood, metadata=metadata, timeout=10)))
    assert [error.code() for error in refused] == [
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.INVALID_ARGUMENT,
    ]
    assert metric_sum(orchestrator.registry, AUTH_FAILURES_TOTAL, reason="missing_key") == 1

    def receive_outcomes(name: str) -> list[object]:
        return [
            (span.attributes or {}).get("classify.outcome")
            for span in span_exporter.get_finished_spans()
            if span.name == name
        ]

    await wait_until(lambda: len(receive_outcomes("grpc_receive")) == 2, "both front-door calls")
    assert sorted(receive_outcomes("grpc_receive"), key=str) == [None, "not_read"]
    await wait_until(
        lambda: receive_outcomes("capability_receive") == ["not_read"], "the capability"
    )


async def test_a_callers_baggage_is_not_read_at_the_front_door(
    secured: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """180 malformed baggage entries on a call without a key: refused, and the entries
    are never parsed (each once logged a warning of its own)."""
    orchestrator, _ = await secured()
    junk = ",".join(f"k{i}=v v" for i in range(180))
    with caplog.at_level(logging.WARNING):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            error = await refusal(
                stub.Classify(pb.ClassifyRequest(text=STRIKER), metadata=(("baggage", junk),))
            )
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert [r.name for r in caplog.records if r.name.startswith("opentelemetry")] == []


@pytest.mark.parametrize(
    ("tenants", "message"),
    [
        pytest.param(
            "tenants:\n  acme: {rate_per_second: .nan, burst: 3}\n",
            "{path}:4: tenants.acme.rate_per_second: nan is not a finite number",
            id="rate-nan",
        ),
        pytest.param(
            "tenants:\n  acme: {rate_per_second: .inf, burst: 3}\n",
            "{path}:4: tenants.acme.rate_per_second: inf is not a finite number",
            id="rate-inf",
        ),
        # A burst past a float's range loaded, then float(burst) in the limiter raised
        # OverflowError: a traceback at start. No integer a setting needs is written in
        # over 100 characters; refused as the file is read.
        pytest.param(
            f"tenants:\n  acme: {{rate_per_second: 2, burst: {PAST_FLOAT}}}\n",
            "{path}:4:37: a whole number written in 401 characters; no setting needs more than 100",
            id="burst-past-float",
        ),
        pytest.param(
            "tenants:\n  acme: {rate_per_second: 1000000001, burst: 3}\n",
            "{path}:4: tenants.acme: rate_per_second 1000000001 is above 1000000000",
            id="rate-above-bound",
        ),
        pytest.param(
            "tenants:\n  acme: {rate_per_second: 2, burst: 3}\n"
            "  123: {rate_per_second: 1, burst: 1}\n",
            "{path}:5: tenants.123: YAML reads a tenant name as the int 123, not a string; "
            "quote it",
            id="tenant-int",
        ),
        pytest.param(
            "tenants:\n  on: {rate_per_second: 2, burst: 3}\n",
            "{path}:3: tenants: YAML reads a tenant name as the bool True (yes, no, on, off, "
            "true or false, unquoted), not a string; quote it",
            id="tenant-bool",
        ),
    ],
)
def test_a_tenant_limit_that_would_not_limit_stops_start_up_naming_file_and_line(
    tmp_path: Path, tenants: str, message: str
) -> None:
    """`.nan` passed the `<= 0` check and switched the tenant's limit off; `123:` was
    refused as "missing required key '123'", naming a key that is there. The refusal
    names the flag and variable first, as every start-up refusal of a setting does."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        f"keys:\n  - {{id: a, sha256: {hash_key(ACME_KEY)}, tenant: acme, role: user}}\n" + tenants
    )
    routes = write_routes(tmp_path / "routes.yaml", ["127.0.0.1:50052"])
    with pytest.raises(SettingsError) as caught:
        OrchestratorServer(
            orchestrator_settings(routes_file=routes, auth="required", api_keys_file=keys),
            registry=CollectorRegistry(),
        )
    assert str(caught.value) == "--api-keys-file / ORCHESTRATOR_API_KEYS_FILE: " + message.format(
        path=keys
    )
    assert isinstance(caught.value.__cause__, KeysFileError)


async def test_a_quoted_numeric_tenant_name_limits_the_keys_of_that_tenant(
    secured: Start,
) -> None:
    """The fix the refusal above asks for works: `tenant: "123"`, as `new-key --tenant
    123` prints it, is the tenant '123' that a quoted name under `tenants` limits."""
    orchestrator, _ = await secured(
        tenants="tenants:\n  '123': {rate_per_second: 0.001, burst: 1}\n", acme_tenant='"123"'
    )
    await call(orchestrator, metadata=bearer(ACME_KEY))
    error = await refusal(call(orchestrator, metadata=bearer(ACME_KEY)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert metric_sum(orchestrator.registry, RATE_LIMITED_TOTAL, tenant="123") == 1


async def test_the_access_line_names_the_key_and_tenant_of_the_call(
    secured: Start, interceptor_log: LineCollector, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator tracing a run of calls, or a ReloadModel, to who made it found neither
    on the line (key IDs and tenants are no secrets; the key itself never appears)."""
    orchestrator, _ = await secured()
    caplog.set_level(logging.INFO, logger=interceptor.__name__)  # the "rpc" lines
    await call(orchestrator, metadata=(*bearer(ACME_KEY), ("x-request-id", "who-1")))
    entries = [json.loads(line) for line in interceptor_log.lines]
    lines = [e for e in entries if e["event"] == "rpc" and e.get("request_id") == "who-1"]
    # The capability's line (no route: it routes nothing) has no caller of its own.
    (line,) = [e for e in lines if "route" in e]
    assert (line["code"], line["tenant"], line["key_id"]) == ("OK", "acme", "a")
    assert ACME_KEY not in "\n".join(interceptor_log.lines)
