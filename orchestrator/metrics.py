"""Orchestrator metrics beyond the per-RPC ones every server has."""

from __future__ import annotations

import contextlib
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from orchestrator.policy.concurrency import AdaptiveConcurrencyLimit

UPSTREAM_RETRIES_TOTAL = "classify_upstream_retries_total"
MODEL_FALLBACK_TOTAL = "model_fallback_total"
RETRY_BUDGET_EXHAUSTED_TOTAL = "classify_retry_budget_exhausted_total"
OUTLIER_EJECTIONS_TOTAL = "classify_outlier_ejections_total"
ROUTES_RELOADS_TOTAL = "classify_routes_reloads_total"
ROUTES_FILE_REFUSED = "classify_routes_file_refused"
API_KEYS_RELOADS_TOTAL = "classify_api_keys_reloads_total"
API_KEYS_FILE_REFUSED = "classify_api_keys_file_refused"
PROCESSING_TOTAL = "classify_processing_total"
REQUEST_DURATION_SECONDS = "classify_request_duration_seconds"
RATE_LIMITED_TOTAL = "classify_rate_limited_total"
RATE_LIMITED_ITEMS_TOTAL = "classify_rate_limited_items_total"
AUTH_FAILURES_TOTAL = "classify_auth_failures_total"
FRONT_DOOR_BUSY_TOTAL = "classify_front_door_busy_total"
LATE_ARRIVAL_SHARE = "classify_late_arrival_share"
UPSTREAM_CALL_ITEMS = "classify_upstream_call_items"
UPSTREAM_ITEMS_EXPIRED_TOTAL = "classify_upstream_items_expired_total"
BATCH_CALL_ITEMS = "classify_batch_call_items"
CONCURRENCY_LIMITED_TOTAL = "classify_concurrency_limited_total"
DEADLINE_UNREACHABLE_TOTAL = "classify_upstream_deadline_unreachable_total"
BACKEND_CONCURRENCY_LIMIT = "classify_backend_concurrency_limit"
BACKEND_IN_FLIGHT = "classify_backend_in_flight"
SHADOW_COMPARISONS_TOTAL = "classify_shadow_comparisons_total"
SHADOW_SCORE_DIFFERENCE = "classify_shadow_score_difference"
SHADOW_DROPPED_TOTAL = "classify_shadow_dropped_total"
# The label values of the labelled counters that alerts and panels read with
# increase() or rate(), each exported at 0 from the start (see _export_at_zero).
# Outcomes of an edit of a watched file (the routes file, the API keys file).
ROUTES_RELOAD_OUTCOMES = ("ok", "failed")
# The causes orchestrator.security.gate refuses a caller for.
AUTH_FAILURE_REASONS = ("missing_key", "repeated_key", "unknown_key")
# The limit a call refused CONCURRENCY_LIMITED met (the `kind` of
# classify_concurrency_limited_total): the backend's max_concurrency in routes.yaml,
# or its adaptive limit.
LIMIT_STATIC = "static"
LIMIT_ADAPTIVE = "adaptive"
LIMIT_KINDS = (LIMIT_STATIC, LIMIT_ADAPTIVE)
# Why a call was refused DEADLINE_UNREACHABLE unsent (the `cause` of
# classify_upstream_deadline_unreachable_total): the replica's reported wait, the
# time calls of its size have been taking there, or a deadline shorter than the
# margin the orchestrator keeps to answer (the caller's doing, not the backend's load).
UNREACHABLE_REPORTED_WAIT = "reported_wait"
UNREACHABLE_CALL_TIME = "call_time"
UNREACHABLE_MARGIN = "margin"
UNREACHABLE_CAUSES = (UNREACHABLE_REPORTED_WAIT, UNREACHABLE_CALL_TIME, UNREACHABLE_MARGIN)


class BackendLoad(Protocol):
    """What a backend pool shows of its load (orchestrator.upstream.pool.BackendPool)."""

    @property
    def calls_in_flight(self) -> int: ...

    @property
    def concurrency(self) -> AdaptiveConcurrencyLimit | None: ...

    def concurrency_limit(self) -> float | None: ...


class UpstreamMetrics:
    """How the calls to capability servers are coalesced, by backend."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._items = Histogram(
            UPSTREAM_CALL_ITEMS,
            "Requests carried by each call to a capability server (coalesced calls carry many).",
            ["backend"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=registry,
        )
        self._expired = Counter(
            UPSTREAM_ITEMS_EXPIRED_TOTAL,
            "Requests answered DEADLINE_EXCEEDED while waiting to be sent upstream; never sent.",
            ["backend"],
            registry=registry,
        )

        self._limited = Counter(
            CONCURRENCY_LIMITED_TOTAL,
            "Calls refused at once because the backend had as many in flight as its "
            "concurrency limit, by kind: static (max_concurrency) or adaptive.",
            ["backend", "kind"],
            registry=registry,
        )
        self._unreachable = Counter(
            DEADLINE_UNREACHABLE_TOTAL,
            "Calls not sent to a backend because they could not make their deadline there "
            "(sent to a fallback, or refused DEADLINE_EXCEEDED), by cause: reported_wait "
            "(the replica's), call_time (calls of their size), margin (the deadline was "
            "shorter than the time the orchestrator keeps to answer).",
            ["backend", "cause"],
            registry=registry,
        )
        self._limit = Gauge(
            BACKEND_CONCURRENCY_LIMIT,
            "The backend's concurrency limit in force (calls in flight): the lower of its "
            "max_concurrency and its adaptive limit; absent when it has neither.",
            ["backend"],
            registry=registry,
        )
        self._in_flight = Gauge(
            BACKEND_IN_FLIGHT, "Calls in flight to the backend.", ["backend"], registry=registry
        )
        # The pool each backend's series read (watch_concurrency).
        self._watched: dict[str, BackendLoad] = {}

    def concurrency_limited(self, backend: str) -> dict[str, Counter]:
        """The backend's refusal counters by LIMIT_KINDS, each exported at 0 from now:
        the ClassifyLoadShedding alert reads them with rate(), which sees no increase
        in a series that first appears at 1."""
        return {kind: self._limited.labels(backend, kind) for kind in LIMIT_KINDS}

    def deadline_unreachable(self, backend: str) -> dict[str, Counter]:
        """The backend's counters by UNREACHABLE_CAUSES, each exported at 0 from now (as
        concurrency_limited's)."""
        return {cause: self._unreachable.labels(backend, cause) for cause in UNREACHABLE_CAUSES}

    def watch_concurrency(self, backend: str, pool: BackendLoad) -> None:
        """Read the backend's limit in force and calls in flight at each scrape (the pool
        of the routes in force: a reload points the series at its new pool, and takes
        the limit's series away when the new one has no limit)."""
        self._watched[backend] = pool
        self._in_flight.labels(backend).set_function(lambda: pool.calls_in_flight)
        if pool.concurrency_limit() is None:
            self._limit.remove(backend)
            return
        self._limit.labels(backend).set_function(lambda: pool.concurrency_limit() or 0.0)

    def unwatch_concurrency(self, backend: str, pool: BackendLoad) -> None:
        """Take the backend's series away when `pool`, the one they read, has closed: an
        edit removed the backend (one that replaced its pool pointed them elsewhere)."""
        if self._watched.get(backend) is not pool:
            return
        del self._watched[backend]
        for gauge in (self._in_flight, self._limit):
            with contextlib.suppress(KeyError):
                gauge.remove(backend)

    def items_per_call(self, backend: str) -> Histogram:
        return self._items.labels(backend)

    def expired_unsent(self, backend: str) -> Counter:
        return self._expired.labels(backend)


class ShadowMetrics:
    """What shadow calls found: agreement with the answer the caller got, score
    differences, and shadow calls not made because too many were in flight."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.comparisons = Counter(
            SHADOW_COMPARISONS_TOTAL,
            "Shadow calls compared with the primary answer, by route, primary and shadow "
            "backend, and outcome: agree (same top label), disagree, error (the shadow failed).",
            ["route", "primary", "shadow", "outcome"],
            registry=registry,
        )
        self.score_difference = Histogram(
            SHADOW_SCORE_DIFFERENCE,
            "Largest absolute difference of one label's score between the primary and the "
            "shadow answer, per comparison.",
            ["route", "primary", "shadow"],
            buckets=(0.0001, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1),
            registry=registry,
        )
        self.dropped = Counter(
            SHADOW_DROPPED_TOTAL,
            "Shadow calls not made because the cap on shadow calls in flight was reached.",
            ["route"],
            registry=registry,
        )


class OrchestratorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.upstream = UpstreamMetrics(registry)
        self.shadow = ShadowMetrics(registry)
        self._add_policy_metrics(registry)
        self._add_request_metrics(registry)

    def _add_policy_metrics(self, registry: CollectorRegistry) -> None:
        """Retries, the retry budget, outlier ejections and routes reloads."""
        self.retries = Counter(
            UPSTREAM_RETRIES_TOTAL,
            "Attempts after the first on a backend, by route, backend and the failure retried.",
            ["route", "backend", "reason"],
            registry=registry,
        )
        self.retry_budget_exhausted = Counter(
            RETRY_BUDGET_EXHAUSTED_TOTAL,
            "Retries not made because the retry budget was spent.",
            ["route", "backend"],
            registry=registry,
        )
        self.outlier_ejections = Counter(
            OUTLIER_EJECTIONS_TOTAL,
            "Replicas taken out of rotation after failing in a row.",
            ["backend", "target"],
            registry=registry,
        )
        self.routes_reloads = Counter(
            ROUTES_RELOADS_TOTAL,
            "Edits of the routes file, by outcome: ok (applied) or failed (refused).",
            ["outcome"],
            registry=registry,
        )
        _export_at_zero(self.routes_reloads, ROUTES_RELOAD_OUTCOMES)
        # A refused edit is counted once; the file stays refused until it changes, and
        # a restart then fails on it. This says so for as long as it lasts.
        self.routes_file_refused = Gauge(
            ROUTES_FILE_REFUSED,
            "1 while the routes file on disk is one the orchestrator refused (it serves "
            "the routes before it, and a restart would fail on it); 0 once it applies.",
            registry=registry,
        )
        # The same two for the API keys file (--api-keys-file), with --auth required.
        self.api_keys_reloads = Counter(
            API_KEYS_RELOADS_TOTAL,
            "Edits of the API keys file, by outcome: ok (applied) or failed (refused).",
            ["outcome"],
            registry=registry,
        )
        _export_at_zero(self.api_keys_reloads, ROUTES_RELOAD_OUTCOMES)
        self.api_keys_file_refused = Gauge(
            API_KEYS_FILE_REFUSED,
            "1 while the API keys file on disk is one the orchestrator refused (it serves "
            "the keys before it, and a restart would fail on it); 0 once it applies.",
            registry=registry,
        )

    def _add_request_metrics(self, registry: CollectorRegistry) -> None:
        """What callers got: latency, PROCESSING, fallbacks, refusals at the door."""
        self.batch_items = Histogram(
            BATCH_CALL_ITEMS,
            "Items in each public ClassifyBatch call.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=registry,
        )
        self.request_duration = Histogram(
            REQUEST_DURATION_SECONDS,
            "Classify calls (and ClassifyBatch items) from the handler's start to the"
            " answer, by route, answering model and code.",
            ["route", "model", "code"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.processing = Counter(
            PROCESSING_TOTAL,
            "Calls answered PROCESSING because the route's time budget ran out first.",
            ["route"],
            registry=registry,
        )
        # The name the design uses, without our prefix, so dashboards can rely on it.
        self.fallbacks = Counter(
            MODEL_FALLBACK_TOTAL,
            "Calls answered by a fallback backend, by route, failed and answering backend, reason.",
            ["route", "from", "to", "reason"],
            registry=registry,
        )
        self.rate_limited = Counter(
            RATE_LIMITED_TOTAL,
            "Calls refused whole (RESOURCE_EXHAUSTED) because their tenant was over its "
            "rate limit.",
            ["tenant"],
            registry=registry,
        )
        self.rate_limited_items = Counter(
            RATE_LIMITED_ITEMS_TOTAL,
            "Requests (single calls, and ClassifyBatch items, whether their call was "
            "refused whole or in part) refused because their tenant was over its rate limit.",
            ["tenant"],
            registry=registry,
        )
        self.late_arrivals = Gauge(
            LATE_ARRIVAL_SHARE,
            "Share of recent calls with deadlines that reached the orchestrator with them "
            "spent (smoothed, the highest tenant's; see --max-late-arrivals).",
            registry=registry,
        )
        self.front_door_busy = Counter(
            FRONT_DOOR_BUSY_TOTAL,
            "Calls refused while calls reached the orchestrator with their deadlines spent.",
            registry=registry,
        )
        self.auth_failures = Counter(
            AUTH_FAILURES_TOTAL,
            "Calls refused as unauthenticated, by cause (missing_key, repeated_key, unknown_key).",
            ["reason"],
            registry=registry,
        )
        _export_at_zero(self.auth_failures, AUTH_FAILURE_REASONS)


def _export_at_zero(counter: Counter, values: tuple[str, ...]) -> None:
    """Make `counter`'s series for each of `values` now, at 0.

    NOTE: a labelled series is exported only once made; made at its first event, it
    appears at 1, and increase() and rate() see no increase in a series that starts
    there: the one refused routes edit an alert exists for would never fire it."""
    for value in values:
        counter.labels(value)
