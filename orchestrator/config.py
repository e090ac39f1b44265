"""Orchestrator settings: flags override environment variables override defaults.

Each field is declared once, with its help and bounds (classify_common/settings.py);
the shared server part (host, ports, TLS, telemetry, grace, log level) comes from
ServerSettings.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS, parse_url

from classify_common.server_settings import (
    ServerSettings,
    metrics_port_setting,
    port_setting,
)
from classify_common.settings import (
    SettingsError,
    check_range,
    path_value,
    setting,
)
from classify_common.tls import ClientTls, check_ca_file, client_tls
from orchestrator.policy.backlog import BacklogSettings
from orchestrator.policy.concurrency import ConcurrencySettings
from orchestrator.shadow import DEFAULT_MAX_IN_FLIGHT as DEFAULT_SHADOW_MAX_IN_FLIGHT
from orchestrator.upstream.coalescer import CoalescingSettings

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9101
DEFAULT_ROUTES_FILE = Path("routes.yaml")
DEFAULT_AUTH = "required"
DEFAULT_ROUTES_POLL_SECONDS = 0.5
DEFAULT_KEYS_POLL_SECONDS = 1.0
DEFAULT_RESULTS_CAPACITY = 10_000
DEFAULT_RESULTS_TTL_SECONDS = 300.0
DEFAULT_UPSTREAM_BATCH_MAX_ITEMS = 128
DEFAULT_UPSTREAM_CALLS_IN_FLIGHT = 2
DEFAULT_CONCURRENCY_LIMIT = "adaptive"
DEFAULT_CONCURRENCY = ConcurrencySettings()
DEFAULT_BACKLOG = BacklogSettings()
# Highest value --concurrency-max-limit may take; its lowest is --concurrency-min-limit.
MAX_CONCURRENCY_LIMIT = 100_000
DEFAULT_STATE_TIMEOUT_MS = 100
DEFAULT_STATE_RETRY_SECONDS = 1.0
DEFAULT_STATE_LEASE_SECONDS = 10.0
DEFAULT_PROCESSES = 1
MAX_PROCESSES = 256
STATE_URL_SCHEMES = ("redis://", "rediss://")
# The query keys a --state-url may hold: those redis-py parses into a connection's
# options, and the texts its connections take as written (the user, the password, the
# client certificate and the other ssl_ files). Not the other texts it would hand on:
# decode_responses=false, a non-empty text, would turn every reply into a str.
STATE_URL_QUERY_KEYS = frozenset(URL_QUERY_ARGUMENT_PARSERS) | {
    "username",
    "password",
    "client_name",
    "ssl_keyfile",
    "ssl_certfile",
    "ssl_password",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_ciphers",
}
# Those that would set what the orchestrator sets itself (orchestrator.state.connection),
# with why it does: redis-py lets a URL's options win over those passed beside it, so
# each was either undone there or quietly undid it (?protocol=3 sent HELLO again;
# ?ssl_ca_certs= replaced --state-ca-file's CA, and went unchecked at start; a
# ?socket_timeout= was cut short by --state-timeout-ms, or failed every command).
STATE_URL_KEYS_SET_HERE = {
    "socket_timeout": "--state-timeout-ms bounds each command",
    "socket_connect_timeout": (
        "--state-timeout-ms bounds each command, a new connection's set-up included"
    ),
    "timeout": "--state-timeout-ms bounds a command's wait for a free connection",
    "max_connections": "each process keeps its own number of connections",
    "protocol": "it speaks RESP2, which needs no HELLO round trip",
    "retry_on_timeout": "a command that timed out is never sent again, since it may have run",
    "ssl_ca_certs": "give the CA with --state-ca-file, which is checked at start",
}


def processes_count(text: str) -> int:
    """--processes: a number, or `auto`: the cores this process may run on."""
    if text.strip() == "auto":
        return len(os.sched_getaffinity(0))
    return int(text)


@dataclass(frozen=True)
class OrchestratorSettings(ServerSettings):
    ENV_PREFIX: ClassVar[str] = "ORCHESTRATOR_"
    PROG: ClassVar[str] = "python -m orchestrator"
    DESCRIPTION: ClassVar[str] = "Public front door of the classify service."

    port: int = port_setting(DEFAULT_PORT)
    metrics_port: int = metrics_port_setting(DEFAULT_METRICS_PORT)
    # The route table (see routes.yaml for its format).
    routes_file: Path = setting(DEFAULT_ROUTES_FILE, "routes.yaml to load", path_value)
    # Seconds between looks at the routes file for edits, 0 (off) or 0.05..60.
    routes_poll_seconds: float = setting(
        DEFAULT_ROUTES_POLL_SECONDS,
        "look for routes file edits every N seconds (0: never)",
        float,
        low=0.05,
        high=60,
        off=0,
        unit="s",
    )
    # "disabled" is for development only: every caller is anonymous.
    auth: str = setting(
        DEFAULT_AUTH, "required, or disabled (dev only)", choices=("required", "disabled")
    )
    # YAML of hashed API keys, tenants, roles and tenant rate limits; needed when auth
    # is required (see orchestrator/security/keys.py).
    api_keys_file: Path | None = setting(
        None,
        "YAML of hashed API keys and tenant limits (`make run`: .run/api-keys.yaml)",
        path_value,
    )
    # Seconds between looks at the API keys file for edits, 0 (off) or 0.05..60: a
    # key revoked or added, a tenant's limit changed, without a restart.
    keys_poll_seconds: float = setting(
        DEFAULT_KEYS_POLL_SECONDS,
        "look for API keys file edits every N seconds (0: never)",
        float,
        low=0.05,
        high=60,
        off=0,
        unit="s",
    )
    # File holding the token capability servers require from the orchestrator; None sends none.
    internal_token_file: Path | None = setting(
        None, "token sent to capability servers (`make run`: .run/internal-token)", path_value
    )
    # TLS to capability servers: the CA their certificates are signed by, and the
    # orchestrator's own certificate and key where they require mTLS. None: plaintext.
    upstream_ca_file: Path | None = setting(
        None, "CA of the capability servers' certificates (none: plaintext)", path_value
    )
    upstream_cert_file: Path | None = setting(
        None, "certificate shown to capability servers (mTLS)", path_value
    )
    upstream_key_file: Path | None = setting(None, "key of that certificate", path_value)
    # Results kept for GetResult after a PROCESSING answer; past the capacity, the
    # oldest of the tenant holding the most goes (orchestrator.results).
    results_capacity: int = setting(
        DEFAULT_RESULTS_CAPACITY, "results kept for GetResult", int, low=1, high=1_000_000
    )
    results_ttl_seconds: float = setting(
        DEFAULT_RESULTS_TTL_SECONDS,
        "how long a kept result can be polled",
        float,
        low=1,
        high=86400,
        unit="s",
    )
    # Where results and rate-limit buckets live; None keeps them in this process. A
    # redis:// URL (rediss:// for TLS) with an optional password (`redis://:pw@host:6379/0`).
    state_url: str | None = setting(
        None,
        "redis:// or rediss:// URL of the shared state (none: in this process)",
        rule="a redis:// or rediss:// URL",  # checked in __post_init__, never echoed
    )
    # Wins over a password in the URL, which would show in process listings.
    state_password_file: Path | None = setting(
        None, "file holding the password of --state-url's Redis", path_value
    )
    # For rediss:// with a private CA; None: the system's CAs.
    state_ca_file: Path | None = setting(
        None, "CA of the Redis server's certificate (rediss:// only)", path_value
    )
    # Longest a call waits for Redis (each command) before going on without it.
    state_timeout_ms: int = setting(
        DEFAULT_STATE_TIMEOUT_MS,
        "most a call waits for the shared state store per command",
        int,
        low=1,
        high=10_000,
        unit="ms",
    )
    # After a failed command, Redis is not asked again for this long.
    state_retry_seconds: float = setting(
        DEFAULT_STATE_RETRY_SECONDS,
        "after a shared state failure, go without it this long",
        float,
        low=0.01,
        high=60,
        unit="s",
    )
    # A process's lease on the PROCESSING results it holds in Redis, renewed every
    # quarter of it: after the process dies, polls of them answer "send again" once
    # it lapses (orchestrator.state.results). Shorter hands over sooner; longer rides
    # out longer stalls of a process's event loop or of Redis.
    state_lease_seconds: float = setting(
        DEFAULT_STATE_LEASE_SECONDS,
        "lease on this process's PROCESSING results: polls say 'call again' this long after death",
        float,
        low=1,
        high=300,
        unit="s",
    )
    # Worker processes on one port (SO_REUSEPORT) under a supervisor; more than 1
    # needs --state-url (see orchestrator/workers.py).
    processes: int = setting(
        DEFAULT_PROCESSES,
        "orchestrator processes serving the port (auto: one per core; >1 needs --state-url)",
        processes_count,
        low=1,
        high=MAX_PROCESSES,
    )
    # Every orchestrator process that shares --state-url's Redis, on every host: while
    # Redis does not answer, each limits a tenant to 1/N of its rate and burst
    # (orchestrator/state/limits.py). 0 (the default): --processes, this host's. A
    # worker's settings say --processes 1 (orchestrator/workers.py), so 0 is replaced
    # by the set's count when the supervisor's settings are built (check_together),
    # which refuses a count below --processes (the tenant would get more than its rate)
    # and one without --state-url.
    state_processes: int = setting(
        0,
        "orchestrator processes sharing --state-url's Redis, on all hosts (0: --processes; "
        "else at least --processes, and needs --state-url); while it does not answer, each "
        "grants a tenant 1/N of its rate and burst",
        int,
        low=0,
        high=100_000,
    )
    # 1 sends every request on its own (see orchestrator/upstream/coalescer.py).
    upstream_batch_max_items: int = setting(
        DEFAULT_UPSTREAM_BATCH_MAX_ITEMS,
        "most requests merged into one capability call (1: no merging)",
        int,
        low=1,
        high=1024,
    )
    # Requests that arrive while a call is in flight gather for the next call; only a
    # full one (a batch on the replica) leaves beside it (orchestrator/upstream/coalescer.py).
    upstream_calls_in_flight: int = setting(
        DEFAULT_UPSTREAM_CALLS_IN_FLIGHT,
        "calls in flight to one capability replica (per backend): the first takes what has "
        "gathered, the others only full ones (a batch on the replica, as it reports); with "
        "--processes, for all of them (each gets its share)",
        int,
        low=1,
        high=64,
    )
    # See orchestrator/policy/concurrency.py.
    concurrency_limit: str = setting(
        DEFAULT_CONCURRENCY_LIMIT,
        "per-backend calls in flight: adaptive, or off (routes.yaml's max_concurrency only)",
        choices=("adaptive", "off"),
    )
    concurrency_latency_tolerance: float = setting(
        DEFAULT_CONCURRENCY.latency_tolerance,
        "latency over its minimum (a multiple) before the adaptive limit shrinks",
        float,
        low=1,
        high=100,
    )
    concurrency_min_limit: int = setting(
        DEFAULT_CONCURRENCY.min_limit,
        "lowest adaptive limit (calls in flight per backend; with --processes, for all of them)",
        int,
        low=1,
        high=10_000,
    )
    # Its lowest value is --concurrency-min-limit (checked in check_together).
    concurrency_max_limit: int = setting(
        DEFAULT_CONCURRENCY.max_limit,
        "highest adaptive limit (calls in flight per backend, at least the lowest; with "
        "--processes, for all of them)",
        int,
        low=1,
        high=MAX_CONCURRENCY_LIMIT,
    )

    # See orchestrator/policy/backlog.py.
    max_late_arrivals: float = setting(
        DEFAULT_BACKLOG.max_late_share,
        "refuse a tenant's new calls (RESOURCE_EXHAUSTED, FRONT_DOOR_BUSY) while more than this "
        "share of its recent calls reached the orchestrator with their deadlines spent; 0: never",
        float,
        low=0,
        high=1,
    )

    # Past it, a shadowed call is not sent and is counted (orchestrator/shadow.py).
    shadow_max_in_flight: int = setting(
        DEFAULT_SHADOW_MAX_IN_FLIGHT,
        "shadow calls (routes.yaml `shadow`) in flight at most; more are dropped and counted",
        int,
        low=1,
        high=10_000,
    )

    # Not a flag: the processes of the --processes set this one serves in (set by
    # orchestrator/workers.py for each worker; 1 for a process alone). Each holds its
    # share of routes.yaml's `max_concurrency`, which the file gives for the set.
    set_processes: int = 1

    def check_together(self) -> None:
        super().check_together()
        check_range(
            self.concurrency_max_limit,
            self.concurrency_min_limit,
            MAX_CONCURRENCY_LIMIT,
            "--concurrency-max-limit",
            "ORCHESTRATOR_CONCURRENCY_MAX_LIMIT",
        )
        self.upstream_tls()  # refuses an incomplete set of upstream TLS files now
        if self.state_url is not None and (problem := state_url_problem(self.state_url)):
            raise SettingsError(f"--state-url / ORCHESTRATOR_STATE_URL: {problem}")
        if self.processes > 1 and self.state_url is None:
            raise SettingsError(
                f"--processes / ORCHESTRATOR_PROCESSES {self.processes} needs shared state: "
                "set --state-url / ORCHESTRATOR_STATE_URL to a redis:// URL (each process "
                "would otherwise keep its own results and rate limits)"
            )
        if self.state_processes not in (0, self.processes) and self.state_url is None:
            # A process without Redis limits tenants alone, at their full rate: a
            # count of sharers means nothing there (a worker's settings, --processes 1
            # and the resolved count, always come with the --state-url that needed it).
            raise SettingsError(
                f"--state-processes / ORCHESTRATOR_STATE_PROCESSES {self.state_processes} "
                "counts the processes sharing --state-url / ORCHESTRATOR_STATE_URL's Redis, "
                "and none is set"
            )
        if 0 < self.state_processes < self.processes:
            # Each process grants 1/N of a tenant's bucket while Redis does not answer:
            # fewer than those serving this port would grant the tenant more than its rate.
            raise SettingsError(
                f"--state-processes / ORCHESTRATOR_STATE_PROCESSES {self.state_processes} is "
                f"fewer than --processes / ORCHESTRATOR_PROCESSES {self.processes}: it counts "
                "every process sharing the Redis, on all hosts (0: --processes)"
            )
        if self.state_processes == 0:
            # NOTE: resolved once, here: replace() builds a worker's settings from these,
            # keeping the resolved count while setting its --processes to 1.
            object.__setattr__(self, "state_processes", self.processes)
        if self.state_ca_file is not None and not (self.state_url or "").startswith("rediss://"):
            raise SettingsError(
                "--state-ca-file / ORCHESTRATOR_STATE_CA_FILE needs a rediss:// (TLS) "
                "--state-url / ORCHESTRATOR_STATE_URL"
            )
        if self.state_ca_file is not None:
            # As the other TLS files are: a CA file that is missing or holds no
            # certificate was taken here and failed only at the first rediss:// connection.
            check_ca_file(self.state_ca_file, self.names("state_ca_file"))
        if self.auth == "required" and self.api_keys_file is None:
            raise SettingsError(
                "--api-keys-file / ORCHESTRATOR_API_KEYS_FILE is needed while --auth is required "
                "(`make run` creates one in .run/)"
            )

    def coalescing(self) -> CoalescingSettings:
        return CoalescingSettings(
            self.upstream_batch_max_items, self.upstream_calls_in_flight, self.set_processes
        )

    def concurrency(self) -> ConcurrencySettings:
        return replace(
            DEFAULT_CONCURRENCY,
            adaptive=self.concurrency_limit == "adaptive",
            latency_tolerance=self.concurrency_latency_tolerance,
            min_limit=self.concurrency_min_limit,
            max_limit=self.concurrency_max_limit,
            processes=self.set_processes,
        )

    def backlog(self) -> BacklogSettings:
        return BacklogSettings(self.max_late_arrivals)

    def upstream_tls(self) -> ClientTls | None:
        return client_tls(
            self.upstream_ca_file,
            self.upstream_cert_file,
            self.upstream_key_file,
            self.names_of("upstream_ca_file", "upstream_cert_file", "upstream_key_file"),
        )


def state_url_problem(url: str) -> str | None:
    """What is wrong with a --state-url, in words that never repeat the URL: it may hold
    the Redis password. None when it is a redis:// or rediss:// URL with a host, a
    port that parses (a bad port was a traceback from urllib at the first call) and a
    query of STATE_URL_QUERY_KEYS that redis-py reads."""
    if not url.startswith(STATE_URL_SCHEMES):
        return "not a redis:// or rediss:// URL"
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # an unclosed IPv6 bracket
        return "not a valid URL"
    try:
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError:
        return "its port is not a number from 0 to 65535"
    if not parts.hostname:
        return "it names no host"
    # NOTE: redis-py hands a query key it has no parser for to its connection as a
    # keyword argument: a misspelt one (?sokcet_timeout=1), or one only a TLS connection
    # takes given to redis://, was a TypeError traceback at start. The names only, never
    # the values (a password may be among them).
    for key, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if key in STATE_URL_KEYS_SET_HERE:
            why = STATE_URL_KEYS_SET_HERE[key]
            return f"its query key {key!r} sets what the orchestrator sets itself: {why}"
        if key not in STATE_URL_QUERY_KEYS:
            taken = ", ".join(sorted(STATE_URL_QUERY_KEYS - STATE_URL_KEYS_SET_HERE.keys()))
            return f"its query key {key!r} is not one the orchestrator takes ({taken})"
        if key.startswith("ssl_") and parts.scheme != "rediss":
            return f"its query key {key!r} is for rediss:// (TLS) only"
    try:
        # What start-up's BlockingConnectionPool.from_url parses: a query value it
        # cannot read (?db=x, ?socket_read_size=abc) passed here and was a traceback there.
        parse_url(url)
    except ValueError as exc:
        # NOTE: its own words only when they name the query key, never the value or URL.
        named = re.fullmatch(r"Invalid value for '(\w+)' in connection URL\.", str(exc))
        return f"its {named[1]!r} query value is not valid" if named else "redis-py cannot parse it"
    return None
