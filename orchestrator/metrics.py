"""Orchestrator metrics beyond the per-RPC ones every server has."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

UPSTREAM_RETRIES_TOTAL = "classify_upstream_retries_total"
MODEL_FALLBACK_TOTAL = "model_fallback_total"
RETRY_BUDGET_EXHAUSTED_TOTAL = "classify_retry_budget_exhausted_total"
OUTLIER_EJECTIONS_TOTAL = "classify_outlier_ejections_total"
ROUTES_RELOADS_TOTAL = "classify_routes_reloads_total"
PROCESSING_TOTAL = "classify_processing_total"
REQUEST_DURATION_SECONDS = "classify_request_duration_seconds"
RATE_LIMITED_TOTAL = "classify_rate_limited_total"
AUTH_FAILURES_TOTAL = "classify_auth_failures_total"


class OrchestratorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
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
        self.request_duration = Histogram(
            REQUEST_DURATION_SECONDS,
            "Classify calls from routing to answer, by route, answering model and code.",
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
            "Calls refused because their tenant was over its rate limit.",
            ["tenant"],
            registry=registry,
        )
        self.auth_failures = Counter(
            AUTH_FAILURES_TOTAL,
            "Calls refused as unauthenticated, by cause (missing_key, unknown_key).",
            ["reason"],
            registry=registry,
        )
