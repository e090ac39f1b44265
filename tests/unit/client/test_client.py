"""classify_client against real in-process servers: the typed errors, retries after the
server's RetryInfo, PROCESSING followed to DONE, and batches.

The servers share the test session's event loop, so the sync client is driven from
a worker thread (`asyncio.to_thread`); the asyncio client is awaited directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from prometheus_client import CollectorRegistry

from capability.server import CapabilityServer
from classify_client import (
    AsyncClassifyClient,
    BatchItem,
    ClassifyClient,
    ClientError,
    DeadlineExpired,
    InternalError,
    InvalidRequest,
    MessageTooLarge,
    Overloaded,
    PollPolicy,
    RateLimited,
    ResultNotFound,
    RetryEvent,
    RetryPolicy,
    StillProcessing,
    Unauthenticated,
    Unavailable,
    pb,
)
from classify_client._shared import POLLS_AT_ONCE
from classify_client.errors import STATUS_DETAILS_TRAILER
from classify_client.gen.ai.classify.v1 import classify_service_pb2_grpc as pb_grpc
from orchestrator.metrics import (
    LATE_ARRIVAL_SHARE,
    PROCESSING_TOTAL,
    RATE_LIMITED_ITEMS_TOTAL,
    RATE_LIMITED_TOTAL,
)
from orchestrator.security import hash_key, new_key
from orchestrator.server import OrchestratorServer
from tests.conftest import (
    STRIKER,
    closed_port,
    metric_sum,
    orchestrator_settings,
    wait_until,
)
from tests.unit.capability.test_serving import device_occupied
from tests.unit.test_tls import make_certificates, tls_front_door

KEY = new_key()
TENANT = "metered"
# One call at once, then one more every 0.2 s: a second call at once is refused
# with a RetryInfo of about 0.2 s.
METERED = "{rate_per_second: 5, burst: 1}"
# A token every 100 s: the hint is far past any test's deadline.
STARVED = "{rate_per_second: 0.01, burst: 1}"
SHARES = "Shares fell sharply after the bank cut its profit forecast"
# What the client names a call that the caller named none for: 32 hex digits, the
# form of the IDs the server makes.
CLIENT_MADE_REQUEST_ID = re.compile(r"[0-9a-f]{32}")
# A tenant whose 1,024 tokens are one full ClassifyBatch call; the next call finds none
# and is refused whole, with a RetryInfo (about 100 s) past any test's deadline.
ONE_FULL_BATCH = "{rate_per_second: 0.01, burst: 1024}"
# The two clients, for the behaviours both implement.
CLIENT_KINDS = ("sync", "asyncio")

ClassifyBatch = Callable[..., Awaitable[list[BatchItem]]]


@contextlib.asynccontextmanager
async def front_door(
    capability: CapabilityServer,
    directory: Path,
    *,
    limit: str = "",
    budget: str = "",
    model: str = "topic-minilm",
    port: int = 0,
) -> AsyncIterator[OrchestratorServer]:
    """An orchestrator before `capability` that accepts KEY (tenant TENANT, rate `limit`);
    its one route goes to `model` and has the time `budget` when given. It listens on
    `port` (0: any free one)."""
    keys = directory / "keys.yaml"
    keys.write_text(
        f"keys:\n  - {{id: test, sha256: {hash_key(KEY)}, tenant: {TENANT}, role: user}}\n"
        + (f"tenants:\n  {TENANT}: {limit}\n" if limit else "")
    )
    routes = directory / "routes.yaml"
    routes.write_text(
        "version: 1\nbackends:\n"
        f"  minilm: {{model: {model}, targets: ['127.0.0.1:{capability.port}'],"
        " timeout: 30s}\n"
        "routes:\n  - name: default\n    backend: minilm\n"
        + (f"    budget: {budget}\n" if budget else "")
    )
    server = OrchestratorServer(
        orchestrator_settings(
            routes_file=routes,
            routes_poll_seconds=0,
            auth="required",
            api_keys_file=keys,
            port=port,
        ),
        registry=CollectorRegistry(),
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_seconds=0)


def target(server: OrchestratorServer) -> str:
    return f"127.0.0.1:{server.port}"


@contextlib.asynccontextmanager
async def batch_client(kind: str, address: str, **options: object) -> AsyncIterator[ClassifyBatch]:
    """`classify_batch` of a client of `kind` (see CLIENT_KINDS), awaitable either way:
    the sync client's runs in a worker thread, as the servers share this event loop."""
    if kind == "asyncio":
        async with AsyncClassifyClient(address, **options) as aio_client:  # type: ignore[arg-type]
            yield aio_client.classify_batch
        return
    with ClassifyClient(address, **options) as client:  # type: ignore[arg-type]

        async def classify_batch(*args: Any, **kwargs: Any) -> list[BatchItem]:
            return await asyncio.to_thread(client.classify_batch, *args, **kwargs)

        yield classify_batch


async def test_a_reject_raises_invalid_request_with_each_violation_and_the_ids(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    async with (
        front_door(capability, tmp_path) as server,
        AsyncClassifyClient(target(server), api_key=KEY) as client,
    ):
        with pytest.raises(InvalidRequest) as refused:
            await client.classify("   ", top_k=0, request_id="client-reject")
    error = refused.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == "INVALID_REQUEST"
    assert {(v.field, v.rule) for v in error.violations} == {
        ("text", "text.not_blank"),
        ("top_k", "int32.gte_lte"),
    }
    assert error.request_id == "client-reject"
    assert len(error.trace_id) == 32


async def test_a_missing_key_raises_unauthenticated_and_an_unknown_result_not_found(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    async with front_door(capability, tmp_path) as server:
        async with AsyncClassifyClient(target(server)) as anonymous:
            with pytest.raises(Unauthenticated) as no_key:
                await anonymous.classify(STRIKER)
        async with AsyncClassifyClient(target(server), api_key=KEY) as client:
            with pytest.raises(ResultNotFound) as unknown:
                await client.get_result("never-sent")
    assert (no_key.value.code, no_key.value.reason) == (
        grpc.StatusCode.UNAUTHENTICATED,
        "UNAUTHENTICATED",
    )
    assert len(no_key.value.request_id) == len(no_key.value.trace_id) == 32
    assert (unknown.value.code, unknown.value.reason) == (
        grpc.StatusCode.NOT_FOUND,
        "RESULT_NOT_FOUND",
    )


async def test_a_rate_limited_call_is_retried_after_the_servers_retry_info_delay(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    retries: list[RetryEvent] = []
    async with front_door(capability, tmp_path, limit=METERED) as server:
        with ClassifyClient(target(server), api_key=KEY, on_retry=retries.append) as client:
            first = await asyncio.to_thread(client.classify, STRIKER)
            second = await asyncio.to_thread(client.classify, STRIKER)
    assert first.labels[0].name == second.labels[0].name == "sports"
    (retry,) = retries
    assert isinstance(retry.error, RateLimited)
    assert (retry.method, retry.attempt, retry.error.metadata["tenant"]) == ("Classify", 1, TENANT)
    assert retry.error.retry_after_seconds is not None
    assert retry.delay_seconds >= retry.error.retry_after_seconds
    # The server refused once: the retry came when its bucket had a token again.
    assert metric_sum(server.registry, RATE_LIMITED_TOTAL, tenant=TENANT) == 1


async def test_a_retry_info_delay_past_the_deadline_is_not_waited_for(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    retries: list[RetryEvent] = []
    async with (
        front_door(capability, tmp_path, limit=STARVED) as server,
        AsyncClassifyClient(target(server), api_key=KEY, on_retry=retries.append) as client,
    ):
        await client.classify(STRIKER)
        with pytest.raises(RateLimited) as refused:
            await client.classify(STRIKER, timeout=5)
    assert retries == []
    assert refused.value.retry_after_seconds is not None
    assert refused.value.retry_after_seconds > 5
    assert metric_sum(server.registry, RATE_LIMITED_TOTAL, tenant=TENANT) == 1


def test_an_unreachable_server_is_tried_max_attempts_times_then_raises_unavailable() -> None:
    """Without a deadline nothing bounds a wait for the server, so retries stay
    fail-fast; the error raised names its attempts and carries the earlier ones'."""
    retries: list[RetryEvent] = []
    policy = RetryPolicy(max_attempts=3, initial_backoff_seconds=0.01, max_backoff_seconds=0.02)
    with (
        ClassifyClient(
            f"127.0.0.1:{closed_port()}", retry=policy, on_retry=retries.append
        ) as client,
        pytest.raises(Unavailable) as failed,
    ):
        client.classify(STRIKER, timeout=None)
    error = failed.value
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert [(r.method, r.attempt) for r in retries] == [("Classify", 1), ("Classify", 2)]
    assert all(0 <= r.delay_seconds <= 0.02 for r in retries)
    assert error.attempts == 3
    assert list(error.attempt_errors) == [r.error for r in retries]
    assert error.__notes__[0].startswith("gave up after 3 attempts in ")
    assert error.__notes__[1:] == [f"an earlier attempt failed: {r.error}" for r in retries]


async def test_wait_follows_a_processing_answer_with_get_result_to_done(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    async with (
        front_door(capability, tmp_path, budget="200ms") as server,
        AsyncClassifyClient(target(server), api_key=KEY) as client,
    ):
        async with device_occupied(capability.pool.workers[0]):
            pending = await client.classify(STRIKER, request_id="no-wait-1")
            waiting = asyncio.ensure_future(
                client.classify(STRIKER, request_id="wait-1", wait=True, timeout=30)
            )
            await wait_until(
                lambda: metric_sum(server.registry, PROCESSING_TOTAL, route="default") == 2,
                "both answers PROCESSING",
            )
        done = await waiting
        fetched = await client.get_result("no-wait-1", wait=True, timeout=30)
    assert (pending.status, len(pending.labels)) == (pb.RESULT_STATUS_PROCESSING, 0)
    assert (done.status, done.request_id, done.labels[0].name) == (
        pb.RESULT_STATUS_DONE,
        "wait-1",
        "sports",
    )
    assert (fetched.status, fetched.trace_id) == (pb.RESULT_STATUS_DONE, pending.trace_id)


@pytest.mark.parametrize(
    ("budget", "kept"),
    [("200ms", None), ("20s", "true")],
    ids=["polled-past-the-deadline", "deadline-before-the-budget"],
)
async def test_wait_past_the_deadline_raises_still_processing_with_the_request_id(
    capability: CapabilityServer, tmp_path: Path, budget: str, kept: str | None
) -> None:
    """The client's polls run out of time (a 200 ms budget answers PROCESSING), or the
    server answers the call DEADLINE_EXCEEDED before its budget ends, with the result
    kept (ErrorInfo `result_kept`): that was a plain DeadlineExpired, which said
    nothing of fetching it."""
    async with (
        front_door(capability, tmp_path, budget=budget) as server,
        AsyncClassifyClient(target(server), api_key=KEY) as client,
    ):
        async with device_occupied(capability.pool.workers[0]):
            with pytest.raises(StillProcessing) as late:
                await client.classify(STRIKER, request_id="late-wait-1", wait=True, timeout=1)
        done = await client.get_result("late-wait-1", wait=True, timeout=30)
    assert (late.value.code, late.value.request_id) == (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "late-wait-1",
    )
    assert late.value.metadata.get("result_kept") == kept
    assert done.labels[0].name == "sports"


async def test_a_batch_answers_each_text_in_order_with_its_own_typed_error(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    async with (
        front_door(capability, tmp_path) as server,
        AsyncClassifyClient(target(server), api_key=KEY) as client,
    ):
        items = await client.classify_batch([STRIKER, "   ", SHARES], top_k=1)
    striker, blank, shares = items
    assert striker.response is not None
    assert shares.response is not None
    assert [len(striker.response.labels), striker.response.labels[0].name] == [1, "sports"]
    assert shares.response.labels[0].name == "business"
    assert isinstance(blank.error, InvalidRequest)
    assert [(v.field, v.rule) for v in blank.error.violations] == [
        ("items[1].text", "text.not_blank")
    ]
    assert len(blank.error.request_id) == len(blank.error.trace_id) == 32


async def test_batch_items_past_the_rate_are_sent_again_after_the_retry_info_delay(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    retries: list[RetryEvent] = []
    async with (
        front_door(capability, tmp_path, limit=METERED) as server,
        AsyncClassifyClient(target(server), api_key=KEY, on_retry=retries.append) as client,
    ):
        items = await client.classify_batch([STRIKER, SHARES])
    assert [item.response.labels[0].name for item in items if item.response] == [
        "sports",
        "business",
    ]
    (retry,) = retries
    assert (retry.method, type(retry.error)) == ("ClassifyBatch", RateLimited)
    assert retry.error.retry_after_seconds is not None
    assert retry.delay_seconds >= retry.error.retry_after_seconds
    assert metric_sum(server.registry, RATE_LIMITED_ITEMS_TOTAL, tenant=TENANT) == 1


async def test_tls_with_the_servers_ca_file_answers_and_default_roots_do_not_trust_it(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    make_certificates(tmp_path)
    once = RetryPolicy(max_attempts=1)
    # A bundle as Mozilla's are written: comment lines, in UTF-8, between the
    # certificates. gRPC trusts it; the client's own check raised TypeError on it.
    commented = tmp_path / "commented-ca.pem"
    commented.write_bytes(
        "# Issuer: CN=Főtanúsítvány\n".encode() + (tmp_path / "ca.pem").read_bytes()
    )
    async with tls_front_door(tmp_path, capability.port) as server:
        async with AsyncClassifyClient(target(server), ca_file=tmp_path / "ca.pem") as trusting:
            response = await trusting.classify(STRIKER)
        with ClassifyClient(target(server), ca_file=commented) as trusting_commented:
            commented_response = await asyncio.to_thread(trusting_commented.classify, STRIKER)
        async with AsyncClassifyClient(target(server), tls=True, retry=once) as default_roots:
            with pytest.raises(Unavailable) as untrusted:
                await default_roots.classify(STRIKER, timeout=5)
    assert response.labels[0].name == "sports"
    assert commented_response.labels[0].name == "sports"
    # Refused in the handshake: no server answered, so no reason and no trace ID; the
    # request ID is the one the client sent the call under.
    assert (untrusted.value.code, untrusted.value.reason, untrusted.value.trace_id) == (
        grpc.StatusCode.UNAVAILABLE,
        "",
        "",
    )
    assert CLIENT_MADE_REQUEST_ID.fullmatch(untrusted.value.request_id)


async def test_a_call_without_a_request_id_is_sent_under_one_that_its_retry_reuses(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    retries: list[RetryEvent] = []
    async with front_door(capability, tmp_path, limit=METERED) as server:
        with ClassifyClient(target(server), api_key=KEY, on_retry=retries.append) as client:
            await asyncio.to_thread(client.classify, STRIKER)
            retried = await asyncio.to_thread(client.classify, STRIKER)
    (retry,) = retries
    # The refusal's trailers and the answer name the ID the client made for the call.
    assert CLIENT_MADE_REQUEST_ID.fullmatch(retried.request_id)
    assert retry.error.request_id == retried.request_id


async def test_a_call_no_server_answered_names_the_request_id_it_was_sent_under() -> None:
    retries: list[RetryEvent] = []
    policy = RetryPolicy(max_attempts=3, initial_backoff_seconds=0.01, max_backoff_seconds=0.02)
    async with AsyncClassifyClient(
        f"127.0.0.1:{closed_port()}", retry=policy, on_retry=retries.append
    ) as client:
        with pytest.raises(Unavailable) as made_up:
            await client.classify(STRIKER, timeout=None)
        with pytest.raises(Unavailable) as named:
            await client.classify(STRIKER, request_id="caller-named-1", timeout=None)
    assert CLIENT_MADE_REQUEST_ID.fullmatch(made_up.value.request_id)
    assert [r.error.request_id for r in retries] == [made_up.value.request_id] * 2 + [
        "caller-named-1"
    ] * 2
    assert (named.value.request_id, named.value.trace_id) == ("caller-named-1", "")


async def processing_batch_waited_for(
    capability: CapabilityServer,
    directory: Path,
    kind: str,
    count: int,
    *,
    within: float,
    limit: str = "",
) -> tuple[list[BatchItem], CollectorRegistry]:
    """A `classify_batch(wait=True)` of `count` texts, `within` seconds, by a client of
    `kind`, through a front door (tenant rate `limit`) whose 200 ms budget answers
    every item PROCESSING while the device is held; the device is let go once all
    are. The items, and the front door's registry."""
    texts = [f"{STRIKER} ({number})" for number in range(count)]
    async with (
        front_door(capability, directory, budget="200ms", limit=limit) as server,
        batch_client(kind, target(server), api_key=KEY) as classify_batch,
    ):
        async with device_occupied(capability.pool.workers[0]):
            waiting = asyncio.ensure_future(classify_batch(texts, wait=True, timeout=within))
            await wait_until(
                lambda: metric_sum(server.registry, PROCESSING_TOTAL, route="default") == count,
                "every item answered PROCESSING",
            )
        return await waiting, server.registry


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_wait_on_a_batch_polls_its_processing_items_together_so_all_reach_done(
    capability: CapabilityServer, tmp_path: Path, kind: str
) -> None:
    # One GetResult round at a time for all of them: followed one after another, each
    # item's first poll alone would wait 50 ms, 7.5 s for 150, past the 5 s deadline.
    items, _ = await processing_batch_waited_for(capability, tmp_path, kind, 150, within=5)
    assert [item.error for item in items] == [None] * 150
    assert {
        (item.response.status, item.response.labels[0].name) for item in items if item.response
    } == {(pb.RESULT_STATUS_DONE, "sports")}


# 20 tokens, one ClassifyBatch of 20 items, then 10 a second: each GetResult takes one.
TWENTY_THEN_TEN = "{rate_per_second: 10, burst: 20}"


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_polls_refused_by_the_tenants_rate_leave_the_items_waiting_not_failed(
    capability: CapabilityServer, tmp_path: Path, kind: str
) -> None:
    """The batch took the tenant's every token, so most of the first rounds' polls are
    refused RATE_LIMITED. That refused the poll, not the work: each such item ended
    RateLimited though its result came to DONE, and its caller sent it again."""
    items, registry = await processing_batch_waited_for(
        capability, tmp_path, kind, 20, within=20, limit=TWENTY_THEN_TEN
    )
    assert [item.error for item in items] == [None] * 20
    assert {item.response.status for item in items if item.response} == {pb.RESULT_STATUS_DONE}
    # The polls were refused on the way.
    assert metric_sum(registry, RATE_LIMITED_TOTAL, tenant=TENANT) > 0


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_no_poll_is_sent_without_the_time_to_answer_it(
    capability: CapabilityServer, tmp_path: Path, kind: str
) -> None:
    """400 items stay PROCESSING past the deadline. The sync client's round of polls,
    one after another, ran into the deadline and sent the last ones with no time left:
    the front door counted nearly every call late (FRONT_DOOR_BUSY past a tenth), and
    refused some items' polls for it."""
    texts = [f"{STRIKER} ({number})" for number in range(400)]
    async with (
        front_door(capability, tmp_path, budget="200ms") as server,
        batch_client(kind, target(server), api_key=KEY) as classify_batch,
    ):
        async with device_occupied(capability.pool.workers[0]):
            items = await classify_batch(texts, wait=True, timeout=1)
        late_share = server.registry.get_sample_value(LATE_ARRIVAL_SHARE)
    assert {type(item.error) for item in items} == {StillProcessing}
    assert late_share is not None
    assert late_share < 0.1  # the front door refuses past a tenth (it read 0.99 and 0.17)


async def test_a_last_round_cut_short_by_the_deadline_still_sends_its_poll(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """A 5 s poll interval does not fit a 1.5 s deadline, so the one round waits only
    until 50 ms are left. A sleep overshoots: under 50 ms were left after it, the
    poll was not sent, and a result ready for a second ended StillProcessing."""
    once = PollPolicy(initial_interval_seconds=5, max_interval_seconds=5)
    async with (
        front_door(capability, tmp_path, budget="200ms") as server,
        AsyncClassifyClient(target(server), api_key=KEY, poll=once) as client,
    ):
        async with device_occupied(capability.pool.workers[0]):
            waiting = asyncio.ensure_future(
                client.classify(STRIKER, request_id="last-round-1", wait=True, timeout=1.5)
            )
            await wait_until(
                lambda: metric_sum(server.registry, PROCESSING_TOTAL, route="default") == 1,
                "answered PROCESSING",
            )
        answer = await waiting
    assert (answer.status, answer.request_id) == (pb.RESULT_STATUS_DONE, "last-round-1")


async def test_a_poll_refused_past_the_deadline_ends_still_processing_naming_the_refusal(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """The call took the tenant's one token; the poll is refused with a RetryInfo delay
    past the deadline. It raised RateLimited: read as "refused", the text was sent
    again, though its result was kept and came to DONE."""
    async with (
        front_door(capability, tmp_path, budget="200ms", limit=STARVED) as server,
        AsyncClassifyClient(target(server), api_key=KEY) as client,
    ):
        async with device_occupied(capability.pool.workers[0]):
            with pytest.raises(StillProcessing) as late:
                await client.classify(STRIKER, request_id="polled-1", wait=True, timeout=5)
        refused = metric_sum(server.registry, RATE_LIMITED_TOTAL, tenant=TENANT)
    assert late.value.request_id == "polled-1"
    assert [error.reason for error in late.value.attempt_errors] == ["RATE_LIMITED"]
    assert refused == 1  # one poll, not one more sent into a known refusal


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_a_later_batch_call_refused_whole_fails_its_items_and_the_unsent_ones_only(
    capability: CapabilityServer, tmp_path: Path, kind: str
) -> None:
    # Three calls: 1,024 items (the tenant's every token), 1,024 (refused whole), and 1.
    texts = [f"{SHARES} ({number})" for number in range(2049)]
    async with (
        front_door(capability, tmp_path, limit=ONE_FULL_BATCH, model="topic-static") as server,
        batch_client(kind, target(server), api_key=KEY) as classify_batch,
    ):
        items = await classify_batch(texts, request_id="chunked-1", timeout=30)
    assert len(items) == 2049
    assert all(item.response is not None for item in items[:1024])
    failed = {item.error for item in items[1024:]}
    (error,) = failed
    assert isinstance(error, RateLimited)
    assert (error.code, error.request_id, len(error.trace_id)) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "chunked-1",
        32,
    )
    # The second call was refused whole (its 1,024 items); the third was never sent.
    assert metric_sum(server.registry, RATE_LIMITED_TOTAL, tenant=TENANT) == 1
    assert metric_sum(server.registry, RATE_LIMITED_ITEMS_TOTAL, tenant=TENANT) == 1024


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_classify_batch_refuses_one_str_rather_than_send_each_character(kind: str) -> None:
    once = RetryPolicy(max_attempts=1)
    async with batch_client(kind, f"127.0.0.1:{closed_port()}", retry=once) as classify_batch:
        with pytest.raises(
            TypeError, match=r"^classify_batch takes a sequence of texts, not one str"
        ):
            await classify_batch("abc")


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_a_text_over_the_batch_limit_fails_alone_and_errors_name_the_callers_index(
    capability: CapabilityServer, tmp_path: Path, kind: str
) -> None:
    """The call of the long text alone is refused whole: it raised (as the first call) or
    failed every text after it. An item's error named its place in its call
    (`items[3]`), not among the caller's texts (`items[1027]`)."""
    texts = [SHARES] * 1027 + ["   ", "x" * 1_000_001, SHARES]
    async with (
        front_door(capability, tmp_path, model="topic-static") as server,
        batch_client(kind, target(server), api_key=KEY) as classify_batch,
    ):
        items = await classify_batch(texts, timeout=30)
        (first,) = await classify_batch(texts[1028:1029], timeout=30)
    blank, long, last = items[1027:]
    assert all(item.response is not None for item in items[:1027])
    assert last.response is not None
    assert isinstance(blank.error, InvalidRequest)
    assert [v.field for v in blank.error.violations] == ["items[1027].text"]
    assert "items[1027].text" in str(blank.error)
    assert isinstance(long.error, InvalidRequest)
    assert isinstance(first.error, InvalidRequest)


async def test_a_text_over_grpcs_message_limit_fails_alone_too(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """Over 8 MiB, gRPC itself refuses the text's call (RESOURCE_EXHAUSTED, not the
    service's INVALID_ARGUMENT), and the texts after it were never sent."""
    async with (
        front_door(capability, tmp_path, model="topic-static") as server,
        AsyncClassifyClient(target(server), api_key=KEY) as client,
    ):
        huge, after = await client.classify_batch(["x" * 9_000_000, SHARES], timeout=30)
    assert huge.error is not None
    assert huge.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert after.response is not None


class ScriptedBatches(pb_grpc.ClassifyServiceServicer):
    """A server that answers ClassifyBatch calls as scripted, to see what the client
    sends: the first call's items refused with a short RetryInfo, every later call
    refused whole UNAVAILABLE."""

    def __init__(self) -> None:
        self.calls = 0

    async def Classify(  # noqa: N802 - the gRPC method's name
        self, request: pb.ClassifyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")

    async def GetResult(  # noqa: N802 - the gRPC method's name
        self, request: pb.GetResultRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")

    async def ClassifyBatch(  # noqa: N802 - the gRPC method's name
        self, request: pb.ClassifyBatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyBatchResponse:
        self.calls += 1
        if self.calls > 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted")
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromMilliseconds(10)
        detail = any_pb2.Any()
        detail.Pack(retry)
        refusal = status_pb2.Status(
            code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="slow down", details=[detail]
        )
        return pb.ClassifyBatchResponse(
            results=[pb.ClassifyBatchResult(error=refusal) for _ in request.items]
        )


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_an_item_is_sent_at_most_max_attempts_times_however_its_tries_fail(
    kind: str,
) -> None:
    """Item resends and whole-call retries each counted from one: with the default four
    attempts, an item was sent five times here (sixteen at worst)."""
    scripted = ScriptedBatches()
    server = grpc.aio.server()
    pb_grpc.add_ClassifyServiceServicer_to_server(scripted, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    retries: list[RetryEvent] = []
    policy = RetryPolicy(initial_backoff_seconds=0.01, max_backoff_seconds=0.02)
    try:
        async with batch_client(
            kind, f"127.0.0.1:{port}", retry=policy, on_retry=retries.append
        ) as classify_batch:
            (item,) = await classify_batch([STRIKER], timeout=30)
    finally:
        await server.stop(grace=0)
    assert scripted.calls == 4
    assert [r.attempt for r in retries] == [1, 2, 3]
    assert isinstance(item.error, Unavailable)


def refusal_status(code: grpc.StatusCode, reason: str, retry_ms: int | None = None) -> Any:
    """A google.rpc.Status as the service words a refusal: ErrorInfo, and RetryInfo."""
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="test"))
    details = [info]
    if retry_ms is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromMilliseconds(retry_ms)
        details.append(any_pb2.Any())
        details[-1].Pack(retry)
    return status_pb2.Status(code=code.value[0], message=reason.lower(), details=details)


class OnePushedBack(ScriptedBatches):
    """The first call: item 0 failed for a moment (UNAVAILABLE), item 1 told to come back
    in a minute; every later call answered."""

    def __init__(self) -> None:
        super().__init__()
        self.resent: list[list[str]] = []

    async def ClassifyBatch(  # noqa: N802 - the gRPC method's name
        self, request: pb.ClassifyBatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyBatchResponse:
        self.calls += 1
        if self.calls == 1:
            return pb.ClassifyBatchResponse(
                results=[
                    pb.ClassifyBatchResult(
                        error=refusal_status(grpc.StatusCode.UNAVAILABLE, "MODEL_UNAVAILABLE")
                    ),
                    pb.ClassifyBatchResult(
                        error=refusal_status(
                            grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED", retry_ms=60_000
                        )
                    ),
                ]
            )
        self.resent.append([item.text for item in request.items])
        done = pb.ClassifyResponse(
            status=pb.RESULT_STATUS_DONE, labels=[pb.Label(name="sports", score=0.9)]
        )
        return pb.ClassifyBatchResponse(
            results=[pb.ClassifyBatchResult(response=done) for _ in request.items]
        )


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_one_items_long_pushback_holds_back_no_other_items_retry(kind: str) -> None:
    """The longest wait among a call's refused items decided for all of them: item 1's
    minute, past the deadline, kept item 0 (whose retry fitted) from being sent again."""
    scripted = OnePushedBack()
    server = grpc.aio.server()
    pb_grpc.add_ClassifyServiceServicer_to_server(scripted, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    policy = RetryPolicy(initial_backoff_seconds=0.01, max_backoff_seconds=0.02)
    try:
        async with batch_client(kind, f"127.0.0.1:{port}", retry=policy) as classify_batch:
            answered, pushed_back = await classify_batch(["a", "b"], timeout=5)
    finally:
        await server.stop(grace=0)
    assert scripted.resent == [["a"]]
    assert answered.response is not None
    assert answered.response.labels[0].name == "sports"
    assert pushed_back.error is not None
    assert pushed_back.error.reason == "RATE_LIMITED"


@contextlib.asynccontextmanager
async def scripted_server(servicer: pb_grpc.ClassifyServiceServicer) -> AsyncIterator[str]:
    """A ClassifyService on a loopback port that answers as `servicer` scripts; its address."""
    server = grpc.aio.server()
    pb_grpc.add_ClassifyServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=0)


class RefusedPolls(ScriptedBatches):
    """Every batch item answered PROCESSING; every GetResult refused RATE_LIMITED with a
    RetryInfo of a minute, past any test's deadline."""

    def __init__(self) -> None:
        super().__init__()
        self.polls = 0

    async def ClassifyBatch(  # noqa: N802 - the gRPC method's name
        self, request: pb.ClassifyBatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyBatchResponse:
        return pb.ClassifyBatchResponse(
            results=[
                pb.ClassifyBatchResult(
                    response=pb.ClassifyResponse(
                        status=pb.RESULT_STATUS_PROCESSING, request_id=f"item-{number}"
                    )
                )
                for number in range(len(request.items))
            ]
        )

    async def GetResult(  # noqa: N802 - the gRPC method's name
        self, request: pb.GetResultRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyResponse:
        self.polls += 1
        refusal = refusal_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED", 60_000)
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            refusal.message,
            trailing_metadata=((STATUS_DETAILS_TRAILER, refusal.SerializeToString()),),
        )


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_a_refused_poll_keeps_the_rest_of_its_round_from_being_sent(kind: str) -> None:
    """The asyncio client recorded its polls only once the whole round had ended, so
    each of the round's 40 polls was sent into a refusal it already had."""
    scripted = RefusedPolls()
    async with (
        scripted_server(scripted) as address,
        batch_client(kind, address) as classify_batch,
    ):
        items = await classify_batch(["x"] * 40, wait=True, timeout=5)
    assert {type(item.error) for item in items} == {StillProcessing}
    # The polls already in flight when the first refusal came, and none after it.
    assert 1 <= scripted.polls <= POLLS_AT_ONCE


class OneResultShort(ScriptedBatches):
    """Every ClassifyBatch call answered with one result fewer than it has items."""

    async def ClassifyBatch(  # noqa: N802 - the gRPC method's name
        self, request: pb.ClassifyBatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyBatchResponse:
        done = pb.ClassifyResponse(status=pb.RESULT_STATUS_DONE)
        return pb.ClassifyBatchResponse(
            results=[pb.ClassifyBatchResult(response=done) for _ in request.items[1:]]
        )


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_a_batch_answer_short_of_a_result_raises_internal_error_naming_the_call(
    kind: str,
) -> None:
    """zip(strict=True) raised a bare ValueError, as if the caller's arguments were wrong,
    and the call's request ID was lost."""
    async with (
        scripted_server(OneResultShort()) as address,
        batch_client(kind, address) as classify_batch,
    ):
        with pytest.raises(InternalError) as short:
            await classify_batch(["a", "b", "c"], request_id="short-1", timeout=5)
    assert (short.value.code, short.value.request_id) == (grpc.StatusCode.INTERNAL, "short-1")
    assert short.value.message == (
        "ClassifyBatch answered 2 results for 3 items: the contract gives one per item, in order"
    )


async def test_a_client_certificate_gets_through_a_front_door_that_asks_for_one(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """The client had no way to present one: a front door with mutual TLS could not be
    called with it."""
    make_certificates(tmp_path)
    once = RetryPolicy(max_attempts=1)
    ca = tmp_path / "ca.pem"
    async with tls_front_door(tmp_path, capability.port, tls_client_ca_file=ca) as server:
        async with AsyncClassifyClient(
            target(server),
            ca_file=ca,
            cert_file=tmp_path / "client.pem",
            key_file=tmp_path / "client.key",
        ) as presenting:
            response = await presenting.classify(STRIKER)
        async with AsyncClassifyClient(target(server), ca_file=ca, retry=once) as anonymous:
            with pytest.raises(Unavailable):
                await anonymous.classify(STRIKER, timeout=5)
    assert response.labels[0].name == "sports"
    with pytest.raises(ValueError, match="needs both cert_file and key_file"):
        ClassifyClient(target(server), cert_file=tmp_path / "client.pem")


async def classify_with(kind: str, address: str, *args: Any, **kwargs: Any) -> pb.ClassifyResponse:
    """`classify` of a fresh client of `kind` (see CLIENT_KINDS) with the client options
    in `kwargs` under "options"; the sync client's in a worker thread."""
    options = kwargs.pop("options", {})
    if kind == "asyncio":
        async with AsyncClassifyClient(address, **options) as aio_client:
            return await aio_client.classify(*args, **kwargs)
    with ClassifyClient(address, **options) as client:
        return await asyncio.to_thread(client.classify, *args, **kwargs)


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_a_call_made_while_the_front_door_restarts_is_answered_once_it_is_back(
    capability: CapabilityServer, tmp_path: Path, kind: str
) -> None:
    """Its retries were sent fail-fast: each failed at once inside gRPC's own reconnect
    backoff, so four attempts were spent in 0.2 s of a 10 s deadline."""
    port = closed_port()
    retries: list[RetryEvent] = []
    options = {"api_key": KEY, "on_retry": retries.append}
    calling = asyncio.ensure_future(
        classify_with(kind, f"127.0.0.1:{port}", STRIKER, timeout=10, options=options)
    )
    await asyncio.sleep(1.5)
    assert not calling.done()
    async with front_door(capability, tmp_path, port=port):
        response = await calling
    assert response.labels[0].name == "sports"
    assert [(r.attempt, r.error.code, r.error.reason) for r in retries] == [
        (1, grpc.StatusCode.UNAVAILABLE, "")
    ]


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_a_server_still_down_at_the_deadline_ends_the_call_there_naming_each_attempt(
    kind: str,
) -> None:
    """The retry waits for the server until the deadline, and the error says what the
    attempt before it met: no server could be connected to."""
    started = asyncio.get_running_loop().time()
    with pytest.raises(DeadlineExpired) as down:
        await classify_with(kind, f"127.0.0.1:{closed_port()}", STRIKER, timeout=1.5)
    waited = asyncio.get_running_loop().time() - started
    error = down.value
    assert 1.4 <= waited <= 1.7
    assert (error.code, error.reason, error.trace_id, error.attempts) == (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "",
        "",
        2,
    )
    (unreachable,) = error.attempt_errors
    assert (type(unreachable), unreachable.reason) == (Unavailable, "")
    assert re.fullmatch(r"gave up after 2 attempts in 1\.\d\d s", error.__notes__[0])
    assert error.__notes__[1] == f"an earlier attempt failed: {unreachable}"


def test_tls_files_that_cannot_work_are_refused_when_the_client_is_made(
    tmp_path: Path,
) -> None:
    """gRPC read them only in the handshake: it logged native errors and each attempt
    failed UNAVAILABLE, as if no server were there."""
    make_certificates(tmp_path)
    not_pem = tmp_path / "not-pem.txt"
    not_pem.write_text("not a certificate\n")
    address = f"127.0.0.1:{closed_port()}"
    with pytest.raises(ValueError, match=f"^ca_file {not_pem} holds no usable PEM CA cert"):
        ClassifyClient(address, ca_file=not_pem)
    with pytest.raises(ValueError, match="holds no usable PEM CA certificate"):
        AsyncClassifyClient(address, ca_file=tmp_path / "client.key")
    # A DER certificate, a common mistake for PEM: refused as not PEM (it raised
    # TypeError, and the command-line client printed a traceback).
    der = tmp_path / "ca.der"
    der.write_bytes(ssl.PEM_cert_to_DER_cert((tmp_path / "ca.pem").read_text()))
    with pytest.raises(ValueError, match=f"^ca_file {der} holds no usable PEM CA cert"):
        ClassifyClient(address, ca_file=der)
    with pytest.raises(ValueError, match=r"are not a PEM certificate and its private key \("):
        ClassifyClient(
            address,
            ca_file=tmp_path / "ca.pem",
            cert_file=tmp_path / "client.pem",
            key_file=tmp_path / "ca.key",
        )


@pytest.mark.parametrize(
    ("target", "refusal"),
    [
        ("127.0.0.1:99999?x=1", "holds '?'"),
        ("dns:///127.0.0.1:99999#f", "holds '#'"),
        ("127.0.0.1:99999 ", "holds ' '"),
        ("127.0.0.1:+99999", "port '+99999' is not a number 1 to 65535"),
        ("[::1]:99999x", "port '99999x' is not a number 1 to 65535"),
        ("127.0.0.1:\u0664\u0664\u0663", "is not a number 1 to 65535"),  # Arabic-Indic 443
        ("127.0.0.1:99999/", "names no address after its last '/'"),
    ],
    ids=["query", "fragment", "whitespace", "plus", "suffix", "non-ascii-digits", "slash"],
)
def test_a_target_whose_port_grpc_would_wrap_is_refused_however_it_is_written(
    target: str, refusal: str
) -> None:
    """The port check read the text as written, while gRPC drops a query, a fragment
    and trailing whitespace first (and int() takes a sign): each of these dialled
    127.0.0.1:34463, a port nobody named."""
    refused = f"^target {re.escape(repr(target))}.*{re.escape(refusal)}"
    for client in (ClassifyClient, AsyncClassifyClient):
        with pytest.raises(ValueError, match=refused):
            client(target)


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_a_text_utf8_cannot_carry_is_refused_naming_it(kind: str) -> None:
    """protobuf's bare UnicodeEncodeError named neither the text nor the argument."""
    address = f"127.0.0.1:{closed_port()}"
    with pytest.raises(ValueError, match=r"^text holds '\\ud800' at 4, a lone surrogate"):
        await classify_with(kind, address, "abc \ud800")
    async with batch_client(kind, address) as classify_batch:
        with pytest.raises(ValueError, match=r"^texts\[1\] holds '\\udc00' at 0"):
            await classify_batch(["fine", "\udc00 x"])


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_a_call_on_a_closed_client_raises_value_error_saying_so(kind: str) -> None:
    """The asyncio client raised gRPC's UsageError, which is no ValueError."""
    address = f"127.0.0.1:{closed_port()}"
    if kind == "asyncio":
        aio_client = AsyncClassifyClient(address)
        await aio_client.close()
        with pytest.raises(ValueError, match=r"^the client is closed"):
            await aio_client.classify(STRIKER)
        return
    client = ClassifyClient(address)
    client.close()
    with pytest.raises(ValueError, match=r"^the client is closed"):
        client.get_result("any-1")


@pytest.mark.parametrize("client", [ClassifyClient, AsyncClassifyClient])
@pytest.mark.parametrize("blank", ["", "   "])
def test_an_empty_api_key_is_refused_as_blank_not_sent_as_none(
    client: type[ClassifyClient | AsyncClassifyClient], blank: str
) -> None:
    """A key of spaces was refused, but an empty one (a variable read with a default of
    "") was sent as no key at all, to be refused UNAUTHENTICATED by the server."""
    with pytest.raises(ValueError, match=r"^the API key is blank: pass None to send no key$"):
        client(f"127.0.0.1:{closed_port()}", api_key=blank)


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_wait_for_connection_on_a_closed_client_raises_value_error_saying_so(
    kind: str,
) -> None:
    """The sync client's gRPC thread died with a traceback and it said False after the
    whole timeout; the asyncio client raised gRPC's UsageError."""
    address = f"127.0.0.1:{closed_port()}"
    if kind == "asyncio":
        aio_client = AsyncClassifyClient(address)
        await aio_client.close()
        with pytest.raises(ValueError, match=r"^the client is closed"):
            await aio_client.wait_for_connection(5)
        return
    client = ClassifyClient(address)
    client.close()
    with pytest.raises(ValueError, match=r"^the client is closed"):
        client.wait_for_connection(5)


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_a_client_closed_under_wait_for_connection_ends_it_with_value_error(
    kind: str,
) -> None:
    """The sync client's wait went on for its whole timeout and said False, as if no
    server were there: closing the channel drops gRPC's readiness watch without a word.
    The listener takes the connection and never answers, so the wait is under way (the
    channel dials only once asked to connect) and would go on till its timeout."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.setblocking(False)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        accepted: list[socket.socket] = []

        def dialled() -> bool:
            with contextlib.suppress(BlockingIOError):
                accepted.append(silent.accept()[0])
            return bool(accepted)

        started = time.monotonic()
        if kind == "asyncio":
            aio_client = AsyncClassifyClient(address)
            waiting: asyncio.Future[bool] = asyncio.ensure_future(
                aio_client.wait_for_connection(30)
            )
            await wait_until(dialled, "the client dialled the listener")
            await aio_client.close()
        else:
            client = ClassifyClient(address)
            waiting = asyncio.ensure_future(asyncio.to_thread(client.wait_for_connection, 30))
            await wait_until(dialled, "the client dialled the listener")
            client.close()
        try:
            with pytest.raises(ValueError, match=r"^the client is closed"):
                await asyncio.wait_for(waiting, 10)
        finally:
            for connection in accepted:
                connection.close()
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("kind", CLIENT_KINDS)
@pytest.mark.parametrize("seconds", [None, math.nan, math.inf, 0, -1])
async def test_wait_for_connection_refuses_a_timeout_that_is_no_bound(
    kind: str, seconds: float | None
) -> None:
    """None and NaN waited for ever on a server that is down, where the check exists
    to fail fast."""
    refused = r"^wait_for_connection timeout .* must be a number of seconds above 0"
    address = f"127.0.0.1:{closed_port()}"
    if kind == "asyncio":
        async with AsyncClassifyClient(address) as aio_client:
            with pytest.raises(ValueError, match=refused):
                await asyncio.wait_for(aio_client.wait_for_connection(seconds), 2)  # type: ignore[arg-type]
        return
    with ClassifyClient(address) as client, pytest.raises(ValueError, match=refused):
        client.wait_for_connection(seconds)  # type: ignore[arg-type]


class HeldOrRefused(ScriptedBatches):
    """Classify calls held unanswered until cancelled; with `retry_ms`, each refused
    RATE_LIMITED with a RetryInfo of that many milliseconds instead."""

    def __init__(self, *, retry_ms: int | None = None) -> None:
        super().__init__()
        self.retry_ms = retry_ms

    async def Classify(  # noqa: N802 - the gRPC method's name
        self, request: pb.ClassifyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyResponse:
        self.calls += 1
        if self.retry_ms is None:
            await asyncio.Event().wait()  # until the call is cancelled
        refusal = refusal_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED", self.retry_ms)
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            refusal.message,
            trailing_metadata=((STATUS_DETAILS_TRAILER, refusal.SerializeToString()),),
        )


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_a_client_closed_under_a_call_in_flight_ends_it_with_value_error(
    kind: str,
) -> None:
    """The sync client raised InternalError (CANCELLED), which says the server has a
    bug; the asyncio client a bare CancelledError into a task nobody cancelled."""
    scripted = HeldOrRefused()
    async with scripted_server(scripted) as address:
        if kind == "asyncio":
            aio_client = AsyncClassifyClient(address)
            calling = asyncio.ensure_future(aio_client.classify(STRIKER, request_id="closed-1"))
            await wait_until(lambda: scripted.calls == 1, "the call reached the server")
            await aio_client.close()
        else:
            client = ClassifyClient(address)
            calling = asyncio.ensure_future(
                asyncio.to_thread(client.classify, STRIKER, request_id="closed-1")
            )
            await wait_until(lambda: scripted.calls == 1, "the call reached the server")
            client.close()
        with pytest.raises(ValueError, match=r"^the client is closed") as closed:
            await calling
    assert closed.value.__notes__ == ["the call was sent under request ID closed-1"]


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_a_client_closed_while_a_call_waits_to_retry_ends_it_with_value_error(
    kind: str,
) -> None:
    """After its backoff the retry met gRPC's own refusal of the closed channel: a
    ValueError about an RPC, or (asyncio) a UsageError, no ValueError at all; and only
    once the backoff (here the server's RetryInfo: 20 s) had been waited out."""
    scripted = HeldOrRefused(retry_ms=20_000)
    closing: list[asyncio.Task[None]] = []
    async with scripted_server(scripted) as address:
        if kind == "asyncio":

            def close_during_the_backoff(_: RetryEvent) -> None:
                closing.append(asyncio.get_running_loop().create_task(aio_client.close()))

            aio_client = AsyncClassifyClient(address, on_retry=close_during_the_backoff)
            call = aio_client.classify(STRIKER, request_id="closed-2", timeout=60)
        else:
            client = ClassifyClient(address, on_retry=lambda _: client.close())
            call = asyncio.to_thread(client.classify, STRIKER, request_id="closed-2", timeout=60)
        with pytest.raises(ValueError, match=r"^the client is closed") as closed:
            await asyncio.wait_for(call, 10)
    assert scripted.calls == 1
    assert closed.value.__notes__ == ["the call was sent under request ID closed-2"]


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_a_retry_info_delay_over_an_hour_is_not_waited_for_even_without_a_deadline(
    kind: str,
) -> None:
    """With timeout=None the client waited out whatever the server said: a delay of 10^10 s
    crashed the sync client's time.sleep with OverflowError, and the asyncio client
    slept for centuries."""
    scripted = HeldOrRefused(retry_ms=10**13)
    async with scripted_server(scripted) as address:
        with pytest.raises(RateLimited) as refused:
            await asyncio.wait_for(classify_with(kind, address, STRIKER, timeout=None), 5)
    assert scripted.calls == 1
    assert (refused.value.retry_after_seconds, refused.value.attempts) == (1e10, 1)


async def test_an_api_key_is_sent_without_surrounding_whitespace_and_a_blank_one_refused(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """A key read from a file ends in a newline (refused as a header value); a blank key
    was sent as no key, to be refused UNAUTHENTICATED."""
    with pytest.raises(ValueError, match=r"^the API key is blank"):
        ClassifyClient(api_key="   ")
    async with (
        front_door(capability, tmp_path) as server,
        AsyncClassifyClient(target(server), api_key=f"  {KEY}\n") as client,
    ):
        response = await client.classify(STRIKER)
    assert response.labels[0].name == "sports"


@pytest.mark.parametrize("kind", CLIENT_KINDS)
async def test_a_message_over_grpcs_size_limit_is_a_client_error_not_an_overload(
    kind: str, capability: CapabilityServer
) -> None:
    """gRPC refuses a request over 8 MiB itself: RESOURCE_EXHAUSTED with no reason. It
    was Overloaded, whose contract is "retry after a while": a caller who did so looped
    on a text that can never be sent."""
    address = f"127.0.0.1:{capability.port}"
    with pytest.raises(MessageTooLarge) as refused:
        await classify_with(kind, address, "é" * 4_500_000)
    error = refused.value
    assert isinstance(error, ClientError)
    assert not isinstance(error, Overloaded)
    assert (error.code, error.reason, error.attempts) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "",
        1,
    )
    assert "message larger than max" in error.message
    assert CLIENT_MADE_REQUEST_ID.fullmatch(error.request_id)
