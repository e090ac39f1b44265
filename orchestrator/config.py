"""Orchestrator settings: flags override environment variables override defaults."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from classify_common.settings import SettingsError, add_setting, check_port, check_range
from classify_common.tls import ClientTls, ServerTls, client_tls, server_tls
from orchestrator.policy.concurrency import ConcurrencySettings
from orchestrator.upstream.coalescer import CoalescingSettings

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9101
DEFAULT_ROUTES_FILE = Path("routes.yaml")
DEFAULT_GRACE_SECONDS = 10.0
DEFAULT_ROUTES_POLL_SECONDS = 0.5
DEFAULT_RESULTS_CAPACITY = 10_000
DEFAULT_RESULTS_TTL_SECONDS = 300.0
DEFAULT_UPSTREAM_BATCH_MAX_ITEMS = 128
DEFAULT_UPSTREAM_CALLS_IN_FLIGHT = 2
DEFAULT_CONCURRENCY = ConcurrencySettings()


@dataclass(frozen=True)
class OrchestratorSettings:
    # Interface to bind; containers set 0.0.0.0.
    host: str = DEFAULT_HOST
    # Public gRPC port, 0..65535; 0 picks a free port (logged in the "serving" line).
    port: int = DEFAULT_PORT
    # Prometheus /metrics port, 0..65535; 0 picks a free one, -1 disables it.
    metrics_port: int = DEFAULT_METRICS_PORT
    # The route table (see routes.yaml for its format).
    routes_file: Path = DEFAULT_ROUTES_FILE
    # "required" (default) or "disabled" (development only: every caller is anonymous).
    auth: str = "required"
    # YAML of hashed API keys, tenants, roles and tenant rate limits; needed when auth
    # is required (see orchestrator/security/keys.py).
    api_keys_file: Path | None = None
    # File holding the token capability servers require from the orchestrator; None sends none.
    internal_token_file: Path | None = None
    # TLS: PEM certificate and key to serve with; with a client CA, callers must present
    # a certificate it signed (mTLS). None of them: plaintext.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    # TLS to capability servers: the CA their certificates are signed by, and the
    # orchestrator's own certificate and key where they require mTLS. None: plaintext.
    upstream_ca_file: Path | None = None
    upstream_cert_file: Path | None = None
    upstream_key_file: Path | None = None
    # Seconds between looks at the routes file for edits, 0 (off) or 0.05..60.
    routes_poll_seconds: float = DEFAULT_ROUTES_POLL_SECONDS
    # Results kept for GetResult after a PROCESSING answer, 1..1000000, oldest dropped first.
    results_capacity: int = DEFAULT_RESULTS_CAPACITY
    # Seconds a kept result can be polled, 1..86400.
    results_ttl_seconds: float = DEFAULT_RESULTS_TTL_SECONDS
    # OTLP gRPC receiver for spans, host:port (Jaeger: 4317); None exports nothing.
    otlp_endpoint: str | None = None
    # Share of traces started here that are kept, 0..1 (parent-based).
    trace_sample_ratio: float = 1.0
    # Most requests merged into one call to a capability replica, 1..1024; 1 sends
    # every request on its own (see orchestrator/upstream/coalescer.py).
    upstream_batch_max_items: int = DEFAULT_UPSTREAM_BATCH_MAX_ITEMS
    # Calls in flight to one capability replica (per backend) at once, 1..64;
    # requests that arrive while all are busy gather for the next call.
    upstream_calls_in_flight: int = DEFAULT_UPSTREAM_CALLS_IN_FLIGHT
    # Each backend's calls in flight follow an adaptive limit ("adaptive") or only
    # routes.yaml's static max_concurrency ("off"); see orchestrator/policy/concurrency.py.
    concurrency_limit: str = "adaptive"
    # Latency allowed before the adaptive limit shrinks, as a multiple of the
    # minimum measured, 1..100.
    concurrency_latency_tolerance: float = DEFAULT_CONCURRENCY.latency_tolerance
    # Bounds of the adaptive limit: 1..10000, and min..100000.
    concurrency_min_limit: int = DEFAULT_CONCURRENCY.min_limit
    concurrency_max_limit: int = DEFAULT_CONCURRENCY.max_limit
    # Seconds in-flight calls get to finish on SIGTERM, 0..300.
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        check_port(self.port, "--port", "ORCHESTRATOR_PORT")
        check_port(
            self.metrics_port, "--metrics-port", "ORCHESTRATOR_METRICS_PORT", allow_disabled=True
        )
        check_range(self.grace_seconds, 0, 300, "--grace-seconds", "ORCHESTRATOR_GRACE_SECONDS")
        check_range(
            self.trace_sample_ratio, 0, 1, "--trace-sample-ratio", "ORCHESTRATOR_TRACE_SAMPLE_RATIO"
        )
        check_range(
            self.upstream_batch_max_items,
            1,
            1024,
            "--upstream-batch-max-items",
            "ORCHESTRATOR_UPSTREAM_BATCH_MAX_ITEMS",
        )
        check_range(
            self.upstream_calls_in_flight,
            1,
            64,
            "--upstream-calls-in-flight",
            "ORCHESTRATOR_UPSTREAM_CALLS_IN_FLIGHT",
        )
        if self.concurrency_limit not in ("adaptive", "off"):
            raise SettingsError(
                f"--concurrency-limit / ORCHESTRATOR_CONCURRENCY_LIMIT: "
                f"{self.concurrency_limit!r} is not adaptive or off"
            )
        check_range(
            self.concurrency_latency_tolerance,
            1,
            100,
            "--concurrency-latency-tolerance",
            "ORCHESTRATOR_CONCURRENCY_LATENCY_TOLERANCE",
        )
        check_range(
            self.concurrency_min_limit,
            1,
            10_000,
            "--concurrency-min-limit",
            "ORCHESTRATOR_CONCURRENCY_MIN_LIMIT",
        )
        check_range(
            self.concurrency_max_limit,
            self.concurrency_min_limit,
            100_000,
            "--concurrency-max-limit",
            "ORCHESTRATOR_CONCURRENCY_MAX_LIMIT",
        )
        self.server_tls()  # refuse an incomplete set of TLS files now
        self.upstream_tls()
        if self.auth not in ("required", "disabled"):
            raise SettingsError(
                f"--auth / ORCHESTRATOR_AUTH: {self.auth!r} is not required or disabled"
            )
        if self.auth == "required" and self.api_keys_file is None:
            raise SettingsError(
                "--api-keys-file / ORCHESTRATOR_API_KEYS_FILE is needed while --auth is required "
                "(`make run` creates one in .run/)"
            )
        check_range(
            self.results_capacity,
            1,
            1_000_000,
            "--results-capacity",
            "ORCHESTRATOR_RESULTS_CAPACITY",
        )
        check_range(
            self.results_ttl_seconds,
            1,
            86400,
            "--results-ttl-seconds",
            "ORCHESTRATOR_RESULTS_TTL_SECONDS",
        )
        if self.routes_poll_seconds != 0:
            check_range(
                self.routes_poll_seconds,
                0.05,
                60,
                "--routes-poll-seconds",
                "ORCHESTRATOR_ROUTES_POLL_SECONDS",
            )

    def coalescing(self) -> CoalescingSettings:
        return CoalescingSettings(self.upstream_batch_max_items, self.upstream_calls_in_flight)

    def concurrency(self) -> ConcurrencySettings:
        return replace(
            DEFAULT_CONCURRENCY,
            adaptive=self.concurrency_limit == "adaptive",
            latency_tolerance=self.concurrency_latency_tolerance,
            min_limit=self.concurrency_min_limit,
            max_limit=self.concurrency_max_limit,
        )

    def server_tls(self) -> ServerTls | None:
        return server_tls(
            self.tls_cert_file,
            self.tls_key_file,
            self.tls_client_ca_file,
            "--tls-cert-file / --tls-key-file / --tls-client-ca-file",
        )

    def upstream_tls(self) -> ClientTls | None:
        return client_tls(
            self.upstream_ca_file,
            self.upstream_cert_file,
            self.upstream_key_file,
            "--upstream-ca-file / --upstream-cert-file / --upstream-key-file",
        )

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ
    ) -> OrchestratorSettings:
        parser = argparse.ArgumentParser(
            prog="python -m orchestrator", description="Public front door of the classify service."
        )
        add_setting(
            parser, "--host", "ORCHESTRATOR_HOST", DEFAULT_HOST, "interface to bind", environ
        )
        add_setting(
            parser,
            "--port",
            "ORCHESTRATOR_PORT",
            DEFAULT_PORT,
            "gRPC port (0: any free)",
            environ,
            int,
        )
        add_setting(
            parser,
            "--metrics-port",
            "ORCHESTRATOR_METRICS_PORT",
            DEFAULT_METRICS_PORT,
            "Prometheus port (0: any free, -1: off)",
            environ,
            int,
        )
        add_setting(
            parser,
            "--routes-file",
            "ORCHESTRATOR_ROUTES_FILE",
            DEFAULT_ROUTES_FILE,
            "routes.yaml to load",
            environ,
            Path,
        )
        add_setting(
            parser,
            "--auth",
            "ORCHESTRATOR_AUTH",
            "required",
            "required or disabled (dev only)",
            environ,
        )
        add_setting(
            parser,
            "--api-keys-file",
            "ORCHESTRATOR_API_KEYS_FILE",
            None,
            "YAML of hashed API keys and tenant limits",
            environ,
            Path,
        )
        add_setting(
            parser,
            "--internal-token-file",
            "ORCHESTRATOR_INTERNAL_TOKEN_FILE",
            None,
            "token sent to capability servers",
            environ,
            Path,
        )
        add_setting(
            parser,
            "--results-capacity",
            "ORCHESTRATOR_RESULTS_CAPACITY",
            DEFAULT_RESULTS_CAPACITY,
            "results kept for GetResult",
            environ,
            int,
        )
        add_setting(
            parser,
            "--results-ttl-seconds",
            "ORCHESTRATOR_RESULTS_TTL_SECONDS",
            DEFAULT_RESULTS_TTL_SECONDS,
            "how long a kept result can be polled",
            environ,
            float,
        )
        add_setting(
            parser,
            "--routes-poll-seconds",
            "ORCHESTRATOR_ROUTES_POLL_SECONDS",
            DEFAULT_ROUTES_POLL_SECONDS,
            "look for routes file edits every N seconds (0: never)",
            environ,
            float,
        )
        add_setting(
            parser,
            "--upstream-batch-max-items",
            "ORCHESTRATOR_UPSTREAM_BATCH_MAX_ITEMS",
            DEFAULT_UPSTREAM_BATCH_MAX_ITEMS,
            "most requests merged into one capability call (1: no merging)",
            environ,
            int,
        )
        add_setting(
            parser,
            "--upstream-calls-in-flight",
            "ORCHESTRATOR_UPSTREAM_CALLS_IN_FLIGHT",
            DEFAULT_UPSTREAM_CALLS_IN_FLIGHT,
            "calls in flight to one capability replica before requests gather",
            environ,
            int,
        )
        add_setting(
            parser,
            "--concurrency-limit",
            "ORCHESTRATOR_CONCURRENCY_LIMIT",
            "adaptive",
            "per-backend calls in flight: adaptive, or off (routes.yaml's max_concurrency only)",
            environ,
        )
        add_setting(
            parser,
            "--concurrency-latency-tolerance",
            "ORCHESTRATOR_CONCURRENCY_LATENCY_TOLERANCE",
            DEFAULT_CONCURRENCY.latency_tolerance,
            "latency over its minimum (a multiple) before the adaptive limit shrinks",
            environ,
            float,
        )
        add_setting(
            parser,
            "--concurrency-min-limit",
            "ORCHESTRATOR_CONCURRENCY_MIN_LIMIT",
            DEFAULT_CONCURRENCY.min_limit,
            "lowest adaptive limit (calls in flight per backend)",
            environ,
            int,
        )
        add_setting(
            parser,
            "--concurrency-max-limit",
            "ORCHESTRATOR_CONCURRENCY_MAX_LIMIT",
            DEFAULT_CONCURRENCY.max_limit,
            "highest adaptive limit (calls in flight per backend)",
            environ,
            int,
        )
        add_setting(
            parser,
            "--grace-seconds",
            "ORCHESTRATOR_GRACE_SECONDS",
            DEFAULT_GRACE_SECONDS,
            "drain time on shutdown",
            environ,
            float,
        )
        for flag, env, text in (
            (
                "--tls-cert-file",
                "ORCHESTRATOR_TLS_CERT_FILE",
                "PEM certificate to serve with (TLS)",
            ),
            ("--tls-key-file", "ORCHESTRATOR_TLS_KEY_FILE", "PEM private key (TLS)"),
            (
                "--tls-client-ca-file",
                "ORCHESTRATOR_TLS_CLIENT_CA_FILE",
                "CA for client certificates (mTLS)",
            ),
            (
                "--upstream-ca-file",
                "ORCHESTRATOR_UPSTREAM_CA_FILE",
                "CA of the capability servers' certificates",
            ),
            (
                "--upstream-cert-file",
                "ORCHESTRATOR_UPSTREAM_CERT_FILE",
                "certificate shown to capability servers",
            ),
            ("--upstream-key-file", "ORCHESTRATOR_UPSTREAM_KEY_FILE", "key of that certificate"),
        ):
            add_setting(parser, flag, env, None, text, environ, Path)
        add_setting(
            parser,
            "--otlp-endpoint",
            "ORCHESTRATOR_OTLP_ENDPOINT",
            None,
            "OTLP gRPC host:port for spans (none: no export)",
            environ,
        )
        add_setting(
            parser,
            "--trace-sample-ratio",
            "ORCHESTRATOR_TRACE_SAMPLE_RATIO",
            1.0,
            "share of new traces kept, 0..1",
            environ,
            float,
        )
        add_setting(parser, "--log-level", "ORCHESTRATOR_LOG_LEVEL", "INFO", "log level", environ)
        return cls(**vars(parser.parse_args(argv)))
