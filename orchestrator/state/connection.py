"""One Redis client for the shared state, and the guard around every command.

Every command runs under `--state-timeout-ms`, so a slow Redis costs a call at
most that long, never the event loop. After a command fails (refused, reset,
timed out), commands are not sent for `--state-retry-seconds`: they fail at once
as skipped, so a Redis that is down costs nothing per call while it is down,
and one command per retry period finds out when it is back. A command that
fails unasked carries the time left in that period as its retry hint. Each
outcome is counted in `classify_state_operations_total{operation,outcome}`, and
answered commands' latency in `classify_state_operation_seconds`.

A probe task PINGs Redis every `--state-retry-seconds`, rest or not, and sets
`classify_state_up` (1: answered, 0: not): the alert reads it, because commands
alone say nothing while no call needs Redis (only unlimited tenants calling).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import AuthenticationError, AuthorizationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from classify_common.errors import StateUnavailable
from classify_common.metrics import LabelledHistogram
from classify_common.settings import SettingsError, read_secret
from orchestrator.config import OrchestratorSettings

# Every key the orchestrator writes starts with this (see orchestrator.state).
KEY_PREFIX = "classify:v1:"
STATE_OPERATIONS_TOTAL = "classify_state_operations_total"
STATE_OPERATION_SECONDS = "classify_state_operation_seconds"
STATE_UP = "classify_state_up"
# Connections one process keeps to Redis; calls beyond that wait (within the timeout).
MAX_CONNECTIONS = 64
# Written at start (check_at_start), expiring at once: Redis takes writes from this user.
START_CHECK_KEY = KEY_PREFIX + "start-check"
# Kept from a command's time when the caller's deadline bounds it (run()'s `within`):
# time to go on without Redis and still answer.
DEADLINE_MARGIN_SECONDS = 0.03
# Less time than this left for a command, it is not sent (as with none): the event
# loop's timers fire to the millisecond (libuv), so a command given a fraction of one
# was cut off as it started, counted `deadline` where the call's time had run out.
LEAST_COMMAND_SECONDS = 0.002
# A command cut short by its caller's deadline starts the rest after a failure only
# when it had at least this fraction of --state-timeout-ms: a Redis that stays silent
# that long is failing, not merely slower than one call's deadline.
FAILING_FRACTION = 0.5

# Redis answered, with an error: a wrong password or user, a database number it does
# not have, a command it refuses. Waiting does not help these (see check_at_start).
REFUSALS = (AuthenticationError, AuthorizationError, ResponseError)

T = TypeVar("T")
log = logging.getLogger(__name__)


class StateNotAsked(StateUnavailable):
    """Redis was not asked: the call's deadline left no time for an answer. It says
    nothing of Redis (no rest starts); what a stand-in grants instead, Redis's own
    bucket has not paid for (RedisRateLimits keeps the debt)."""


class StateFailed(StateUnavailable):
    """Redis was asked and did not answer in time, or failed: the command may have run
    (its answer lost), as a timeout cannot tell."""


class StateMetrics:
    """How the shared state store answered, by operation (rate_limit, rate_limit_edit,
    result_hold, result_finish, result_get, result_lease, ping, start_check) and outcome (ok, error,
    timeout, deadline: cut short by its call's deadline to under half the timeout,
    skipped: not sent, cancelled: its caller stopped waiting)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._operations = Counter(
            STATE_OPERATIONS_TOTAL,
            "Commands to the shared state store (Redis), by operation and outcome: ok, "
            "error, timeout, deadline (cut short by its call's deadline to under half "
            "the timeout), skipped (not sent: the store failed moments ago, or the "
            "call's deadline left no time for it), or cancelled (its caller stopped "
            "waiting: the client went, or the server stops).",
            ["operation", "outcome"],
            registry=registry,
        )
        self._seconds = LabelledHistogram(
            STATE_OPERATION_SECONDS,
            "Round trip of answered commands to the shared state store, by operation.",
            ["operation"],
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=registry,
        )
        self._counters: dict[tuple[str, str], Counter] = {}
        self._registry = registry
        self._up: Gauge | None = None

    def set_up(self, answered: bool) -> None:
        """classify_state_up, made at the first PING: only an orchestrator with a Redis
        exports it. Made with the others, it read 0 on every orchestrator without one,
        and ClassifySharedStateUnavailable paged for them all."""
        if self._up is None:
            self._up = Gauge(
                STATE_UP,
                "1 while the shared state store (Redis) answers the probe's PING (one every "
                "--state-retry-seconds), 0 while it does not; with --processes, the lowest "
                "worker's.",
                registry=self._registry,
            )
        self._up.set(1 if answered else 0)

    def count(self, operation: str, outcome: str) -> None:
        key = (operation, outcome)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = self._operations.labels(operation, outcome)
        counter.inc()

    def answered(self, operation: str, seconds: float) -> None:
        self.count(operation, "ok")
        self._seconds.observe(operation, seconds)


class RedisState:
    """The client, and `run()`, the one way a command is sent."""

    def __init__(
        self,
        client: Redis,
        metrics: StateMetrics,
        *,
        timeout_seconds: float,
        retry_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self._metrics = metrics
        self.timeout_seconds = timeout_seconds
        self._retry = retry_seconds
        self._clock = clock
        self._resting_until = float("-inf")
        self._failing = False
        self._probe: asyncio.Task[None] | None = None
        self._closing = False
        self._scripts: list[AsyncScript] = []
        # One per pooled connection: a command waits for one before its timeout starts.
        # Waiting inside it, a burst of this process's own commands (a ClassifyBatch of
        # 1,024 items past its budget, each holding its result's place) timed out at
        # the pool with Redis well: counted as Redis failing, and every call went
        # without it for --state-retry-seconds.
        pool_size = getattr(client.connection_pool, "max_connections", None)
        self._connections = asyncio.Semaphore(
            pool_size if isinstance(pool_size, int) and 0 < pool_size < 2**31 else MAX_CONNECTIONS
        )

    @classmethod
    def from_settings(cls, settings: OrchestratorSettings, metrics: StateMetrics) -> RedisState:
        """A client for --state-url: password from the URL or --state-password-file (which
        wins), TLS for rediss:// (with --state-ca-file's CA, else the system's)."""
        assert settings.state_url is not None
        timeout = settings.state_timeout_ms / 1000
        options: dict[str, Any] = {
            "max_connections": MAX_CONNECTIONS,
            "timeout": None,  # waiting for a free connection is bounded by run()'s timeout
            "socket_connect_timeout": timeout,
            # NOTE: redis-py retries failed commands by default, with backoff; here a
            # failed command fails at once and run() decides what happens next, with
            # one exception: a command that finds its pooled connection dropped is sent
            # once more on a new one. A process that made no call while Redis was away
            # still holds connections to the Redis that went; without this, its first
            # command after Redis returns fails, and its calls fall back to the
            # process's own buckets for --state-retry-seconds. A refused connect fails
            # the retry at once; a timeout is never retried (the command may have run).
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            # NOTE: a new connection's set-up runs inside its first command's timeout,
            # and redis-py's defaults spent a round trip each on HELLO 3, CLIENT
            # MAINT_NOTIFICATIONS (both for RESP3, which nothing here needs), CLIENT
            # SETNAME and CLIENT SETINFO: a Redis a quarter of the timeout away was
            # never reached from a cold start. RESP2, no name, no driver info: none
            # of them (docs/deploy.md: the timeout and round trips).
            "protocol": 2,
            "driver_info": None,
        }
        if settings.state_ca_file is not None:
            options["ssl_ca_certs"] = str(settings.state_ca_file)
        pool = BlockingConnectionPool.from_url(settings.state_url, **options)
        password = read_secret(settings, "state_password_file")
        if password is not None:
            # NOTE: set after from_url, not passed to it: from_url lets the URL's own
            # options override those passed in, so a password in the URL would win.
            pool.connection_kwargs["password"] = password
        # NOTE: no socket timeout (settings refuse a ?socket_timeout= in the URL): run()'s
        # timeout bounds every command, its connection's set-up included. With one,
        # redis-py writes each command under asyncio.wait_for, which in Python 3.11
        # drops a cancellation that lands while the write finishes: a command given
        # next to no time by its call's deadline was written, then waited the whole
        # socket timeout for its answer from a stalled Redis, far past the deadline.
        pool.connection_kwargs["socket_timeout"] = None
        return cls(
            Redis.from_pool(pool),  # the client owns the pool: closing it closes both
            metrics,
            timeout_seconds=timeout,
            retry_seconds=settings.state_retry_seconds,
        )

    def register_script(self, source: str) -> AsyncScript:
        """A Lua script, run by EVALSHA (loaded again when Redis lacks it); check_at_start
        loads every script registered before it."""
        script = self.client.register_script(source)
        self._scripts.append(script)
        return script

    async def run(
        self,
        operation: str,
        command: Callable[[], Awaitable[T]],
        *,
        skip_while_resting: bool = True,
        within: float | None = None,
    ) -> T:
        """`command()`'s answer; StateUnavailable when Redis fails, is slower than the
        timeout, or failed less than the retry period ago (then nothing is sent, unless
        `skip_while_resting` is False: the probe, and outcomes stored again).

        `within`: the seconds the caller has left (its call's deadline; None: no
        deadline). The command is given that less DEADLINE_MARGIN_SECONDS when it is
        less than the timeout, so the caller goes on without Redis in time rather than
        being cancelled while it waits (uncounted, and starting no rest: each call
        after it waited on a stalled Redis too, and failed DEADLINE_EXCEEDED). When
        that leaves it no time at all, it is not sent: skipped, as during a rest."""
        now = self._clock()
        if skip_while_resting and now < self._resting_until:
            self._metrics.count(operation, "skipped")
            raise StateUnavailable(
                "the shared state store failed moments ago; not asked again yet",
                retry_after_seconds=self._resting_until - now,
                operation=operation,
            )
        waited = 0.0
        if self._connections.locked():  # every connection busy with this process's own
            started = time.perf_counter()
            try:
                async with asyncio.timeout(
                    None if within is None else max(within - DEADLINE_MARGIN_SECONDS, 0)
                ):
                    await self._connections.acquire()
            except TimeoutError:
                raise self._not_asked(operation) from None
            waited = time.perf_counter() - started
        else:
            await self._connections.acquire()
        try:
            return await self._send(operation, command, None if within is None else within - waited)
        finally:
            self._connections.release()

    def _not_asked(self, operation: str) -> StateNotAsked:
        # Not sent: no answer could come in time, and a command cut off as it starts
        # closes its connection (the next one opens another). Skipped, not timed out:
        # Redis was not asked, so it says nothing of Redis.
        self._metrics.count(operation, "skipped")
        return StateNotAsked(
            "the call's deadline left no time to ask the shared state store",
            retry_after_seconds=0.0,
            operation=operation,
        )

    async def _send(
        self, operation: str, command: Callable[[], Awaitable[T]], within: float | None
    ) -> T:
        """`command()` on a connection of its own, within the timeout (run())."""
        timeout = self.timeout_seconds
        if within is not None:
            timeout = min(timeout, within - DEADLINE_MARGIN_SECONDS)
            if timeout < LEAST_COMMAND_SECONDS:
                raise self._not_asked(operation)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout):
                answer = await command()
        except asyncio.CancelledError:
            # Its caller stopped waiting: the client went, or the server stops (the
            # timeout above ends as TimeoutError). Counted, or a stall whose callers
            # went away showed only answers; not as a failure: it says nothing of
            # Redis, and starts no rest.
            self._metrics.count(operation, "cancelled")
            raise
        except (TimeoutError, RedisError, OSError) as exc:
            self._raise_if_cancelled(operation, exc)
            if isinstance(exc, TimeoutError) and timeout < self.timeout_seconds * FAILING_FRACTION:
                # NOTE: cut short by a deadline too near to tell a failing Redis from a
                # tight one: counted, but no rest started, so a tenant's tight deadlines
                # never send the whole process to its fallback while Redis is well; and
                # as `deadline`, not `timeout`, which the alert reads as Redis's own
                # (under overload, calls near their deadlines made a fifth of the
                # commands sent `timeout` with Redis well).
                self._metrics.count(operation, "deadline")
                raise StateUnavailable(
                    "the shared state store did not answer before the call's deadline",
                    retry_after_seconds=0.0,
                    operation=operation,
                ) from exc
            outcome = "timeout" if isinstance(exc, TimeoutError) else "error"
            raise self._failed(operation, outcome, exc) from exc
        self._metrics.answered(operation, time.perf_counter() - started)
        if self._failing:
            self._failing = False
            log.warning("shared state store answers again", extra={"operation": operation})
        return answer

    def _failed(self, operation: str, outcome: str, cause: Exception) -> StateFailed:
        self._metrics.count(operation, outcome)
        self._resting_until = self._clock() + self._retry
        if not self._failing:  # one line per outage, not one per call
            self._failing = True
            log.warning(
                "shared state store failed",
                extra={"operation": operation, "outcome": outcome, "error": describe(cause)},
            )
        answered = "refused the command" if isinstance(cause, REFUSALS) else "did not answer"
        return StateFailed(
            f"the shared state store {answered} ({outcome})",
            retry_after_seconds=self._retry,
            operation=operation,
        )

    def _raise_if_cancelled(self, operation: str, failure: BaseException) -> None:
        """Raise CancelledError, counted as cancelled, where the task running a command
        was cancelled and what reached here is another exception: something below
        turned the cancellation into a failure. Counted as one, the probe and the
        lease's renewal took it for Redis failing and went on, and the close()
        awaiting them waited for ever: a test run stopped in a fixture's teardown
        until CI's limit."""
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            self._metrics.count(operation, "cancelled")
            raise asyncio.CancelledError from failure

    async def ping(self) -> bool:
        """Whether Redis answers a PING now, rest or not; sets classify_state_up."""
        return await self._ping() is None

    async def _ping(self) -> StateUnavailable | None:
        """PING Redis, rest or not, and set classify_state_up: the failure, or None."""
        try:
            await self.run("ping", self.client.ping, skip_while_resting=False)
        except StateUnavailable as failure:
            self._metrics.set_up(False)
            return failure
        self._metrics.set_up(True)
        return None

    async def check_at_start(self) -> bool:
        """Whether Redis answers at start-up (False: serve without it until it does).

        SettingsError when it answers with a refusal (a wrong password, a database
        number it lacks, a user not allowed scripts or writes, a read-only replica):
        that never mends itself, so start-up stops and says which settings to fix,
        rather than serving degraded for as long as it runs.

        NOTE: a PING alone passed for a user without scripting (+@all -@scripting) and
        for a replica; then every rate-limit check was refused (NOPERM, READONLY) and
        fell back to the process's share for good. So the scripts are loaded, and a key
        that expires at once is written, as every call's commands will."""
        failure = await self._ping()
        if failure is None:
            failure = await self._check_commands()
        if failure is not None and isinstance(failure.__cause__, REFUSALS):
            raise SettingsError(
                "--state-url / ORCHESTRATOR_STATE_URL: Redis refused the connection "
                f"({describe(failure.__cause__)}); check the password (in the URL or "
                "--state-password-file / ORCHESTRATOR_STATE_PASSWORD_FILE), the "
                "database number (the URL's path), that the user may run scripts and "
                f"write {KEY_PREFIX}* keys, and that the URL names a primary, not a replica"
            ) from failure.__cause__
        return failure is None

    async def _check_commands(self) -> StateUnavailable | None:
        """Load the registered scripts and write START_CHECK_KEY (expiring at once), in
        one round trip: the failure, or None."""

        async def load_and_write() -> None:
            async with self.client.pipeline(transaction=False) as pipe:
                for script in self._scripts:
                    pipe.script_load(script.script)
                pipe.set(START_CHECK_KEY, "1", px=1)
                # Not raised by execute(): it prefixes the command, a whole script here.
                answers = await pipe.execute(raise_on_error=False)
            for answer in answers:
                if isinstance(answer, Exception):
                    raise answer

        try:
            await self.run("start_check", load_and_write, skip_while_resting=False)
        except StateUnavailable as failure:
            return failure
        return None

    def start_probe(self) -> None:
        """PING Redis every --state-retry-seconds, in one task, until close()."""
        if self._probe is None:
            self._probe = asyncio.create_task(self._probe_forever(), name="state-probe")

    async def _probe_forever(self) -> None:
        # Until close(), not only until cancelled: see RedisState._raise_if_cancelled.
        while not self._closing:
            await asyncio.sleep(self._retry)
            await self.ping()

    async def close(self) -> None:
        self._closing = True
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
            self._probe = None
        await self.client.aclose()


def describe(cause: BaseException) -> str:
    """`Type: message` of a failure, for logs (repr() of redis-py's errors drops the
    message: `AuthenticationError()` says nothing of which credentials failed)."""
    message = str(cause)
    name = type(cause).__name__
    return f"{name}: {message}" if message else name
