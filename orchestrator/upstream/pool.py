"""One grpc.aio channel per capability replica, and the call that carries a deadline.

A call's timeout is the smaller of the backend's timeout and the caller's
remaining deadline minus a safety margin, so the capability server sees a
deadline that still leaves the orchestrator time to answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial

import grpc

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import model_service_pb2_grpc as model_pb_grpc
from classify_common.context import INTERNAL_TOKEN_HEADER, cache_scope_of
from classify_common.errors import (
    BackendTimedOut,
    ConcurrencyLimited,
    DeadlineExpired,
    DeadlineUnreachable,
    Overloaded,
)
from classify_common.nodes import cancelled_code
from classify_common.tls import ClientTls
from classify_common.tracing import inject_context
from orchestrator.metrics import (
    LIMIT_ADAPTIVE,
    LIMIT_STATIC,
    UNREACHABLE_MARGIN,
    UNREACHABLE_REPORTED_WAIT,
    UpstreamMetrics,
)
from orchestrator.policy import OutlierDetector, OutlierSettings
from orchestrator.policy.concurrency import (
    AdaptiveConcurrencyLimit,
    ConcurrencySettings,
    share_of,
)
from orchestrator.policy.retries import DEADLINE_SAFETY_MARGIN_SECONDS
from orchestrator.routing import Backend
from orchestrator.security.gate import current_caller
from orchestrator.upstream.addresses import (
    RESOLVE_INTERVAL_SECONDS,
    Address,
    Lookup,
    TargetAddresses,
    lookup_ips,
)
from orchestrator.upstream.coalescer import (
    EXPIRY_RESOLUTION_SECONDS,
    CoalescingSettings,
    ReplicaCoalescer,
)
from orchestrator.upstream.load import ReplicaLoad, read_load_report

log = logging.getLogger(__name__)

DEFAULT_COALESCING = CoalescingSettings()
DEFAULT_CONCURRENCY = ConcurrencySettings()

# Hint sent with a concurrency-limit refusal: about one typical call.
CONCURRENCY_RETRY_AFTER_SECONDS = 0.05
# A call cancelled this close to its caller's deadline, or later, went at the deadline
# (the time left is read just before the call starts; the cancel arrives at or after it).
DEADLINE_CANCEL_MARGIN_SECONDS = 0.01

# (first, longest) wait before dialling a replica that could not be reached again.
RECONNECT_BACKOFF_MS = (500, 2_000)
CHANNEL_OPTIONS: Sequence[tuple[str, int]] = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
    # Room for a batch call's early results in its initial metadata
    # (orchestrator.upstream.coalescer.EARLY_RESULTS_MAX_BYTES); gRPC's default soft
    # limit is 8 KiB, past which it fails calls at random.
    ("grpc.max_metadata_size", 64 * 1024),
    ("grpc.absolute_max_metadata_size", 96 * 1024),
    # gRPC's reconnect backoff grows 1.6x a try up to 120 s: a replica back after a
    # 150 s outage got its first call 40 s later (8 s after one of 60 s), its route's
    # fallback answering all the while. Capped, a replica back in the same place (a
    # container restarted in its pod) is used again within about this long.
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
)


# Each channel dials one address (orchestrator.upstream.addresses), watched
# through gRPC health: a replica that reports NOT_SERVING (warming up, draining
# on SIGTERM) puts its channel in TRANSIENT_FAILURE, and pick() passes it by
# until it is back. Round robin, not pick_first, because only round robin runs
# health checks; until a name's first look-up, it spreads the name's addresses.
HEALTH_CHECKED = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": "ai.classify.v1.ClassifyService"},
    }
)

# A channel whose replica is unreachable or reports NOT_SERVING.
_FAILING = grpc.ChannelConnectivity.TRANSIENT_FAILURE


def open_channel(
    target: str, tls: ClientTls | None = None, authority: str | None = None
) -> grpc.aio.Channel:
    """One channel per replica address. `authority` (name:port) is what an address found
    by looking a name up presents: the :authority header, and the name the server's
    TLS certificate is checked against."""
    options: list[tuple[str, str | int]] = [
        *CHANNEL_OPTIONS,
        ("grpc.service_config", HEALTH_CHECKED),
    ]
    if authority is not None:
        options.append(("grpc.default_authority", authority))
    if tls is not None:
        return grpc.aio.secure_channel(target, tls.credentials(), options)
    return grpc.aio.insecure_channel(target, options)


def call_timeout(backend_timeout: float, client_remaining: float | None) -> float:
    """Seconds the upstream call may take; DeadlineExpired when the caller's deadline
    has passed, DeadlineUnreachable when what is left of it is less than the margin
    the orchestrator keeps to answer."""
    timeout = backend_timeout
    if client_remaining is not None:
        if client_remaining <= 0:
            raise DeadlineExpired("the deadline passed before the backend could be called")
        timeout = min(timeout, client_remaining - DEADLINE_SAFETY_MARGIN_SECONDS)
        if timeout <= 0:
            raise DeadlineUnreachable(
                f"only {client_remaining * 1000:.1f} ms are left, less than the "
                f"{DEADLINE_SAFETY_MARGIN_SECONDS * 1000:.0f} ms the orchestrator keeps to answer",
                remaining_ms=round(client_remaining * 1000, 1),
            )
    return timeout


def cancelled_at_deadline(elapsed: float, client_remaining: float | None) -> bool:
    """Whether a call its caller cancelled after `elapsed` seconds went at the caller's
    deadline (`client_remaining` seconds away when it was sent; None: no deadline)."""
    return (
        client_remaining is not None
        and elapsed >= client_remaining - DEADLINE_CANCEL_MARGIN_SECONDS
    )


class BackendPool:
    """The replicas of one backend, taken in turn, minus those ejected as outliers.

    Calls to a replica go through its coalescer, which merges the calls that are
    waiting for it into one batch call (orchestrator.upstream.coalescer).
    """

    def __init__(
        self,
        backend: Backend,
        outliers: OutlierSettings,
        on_ejected: Callable[[str, float], None] = lambda target, seconds: None,
        internal_token: str | None = None,
        tls: ClientTls | None = None,
        coalescing: CoalescingSettings = DEFAULT_COALESCING,
        metrics: UpstreamMetrics | None = None,
        concurrency: ConcurrencySettings = DEFAULT_CONCURRENCY,
        *,
        lookup: Lookup = lookup_ips,
        resolve_interval_seconds: float = RESOLVE_INTERVAL_SECONDS,
    ) -> None:
        self.backend = backend
        # This process's share of the backend's max_concurrency, which routes.yaml
        # gives for the whole --processes set (each worker reads the same file).
        self.max_concurrency = (
            None
            if backend.max_concurrency is None
            else share_of(backend.max_concurrency, concurrency.processes)
        )
        # Its replicas are the addresses _follow_addresses hands it.
        self.outliers = OutlierDetector((), outliers, on_ejected=on_ejected)
        self.concurrency = AdaptiveConcurrencyLimit(concurrency) if concurrency.adaptive else None
        # The latest load report of each replica.
        self.loads: dict[str, ReplicaLoad] = {}
        # Counters of calls refused unsent, their label children made once here (a
        # labels() look-up per refusal costs what the refusal saves).
        self._count_refused_at_max: Callable[[], None] = lambda: None
        self._count_refused_at_adaptive: Callable[[], None] = lambda: None
        self._count_unreachable: Callable[[str], None] = lambda cause: None
        if metrics is not None:
            limited = metrics.concurrency_limited(backend.name)
            self._count_refused_at_max = limited[LIMIT_STATIC].inc
            self._count_refused_at_adaptive = limited[LIMIT_ADAPTIVE].inc
            unreachable = {
                cause: counter.inc
                for cause, counter in metrics.deadline_unreachable(backend.name).items()
            }
            self._count_unreachable = lambda cause: unreachable[cause]()
            metrics.watch_concurrency(backend.name, self)
        self._credentials: tuple[tuple[str, str], ...] = (
            ((INTERNAL_TOKEN_HEADER, internal_token),) if internal_token else ()
        )
        self.in_flight = 0
        # The pool of the same backend that this one replaced in an edit that changed the
        # backend, while calls that began under the routes before are still in flight
        # on it (see calls_in_flight).
        self._replaced: BackendPool | None = None
        self._closed = False
        # The route tables serving from this pool (an edit that leaves the backend as it
        # was shares it with the routes before it); the last one to go closes it.
        self._holders = 1
        self._tls = tls
        self._coalescing = coalescing
        self._metrics = metrics
        # One replica per address behind the targets, each with its channel and
        # coalescer; `replicas` is the turn order.
        self.replicas: tuple[str, ...] = ()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.coalescers: dict[str, ReplicaCoalescer] = {}
        self._turn = -1  # the replica pick() began with last, in `replicas`
        self._retiring: set[asyncio.Task[None]] = set()
        self._addresses = TargetAddresses(
            backend.targets,
            self._follow_addresses,
            lookup=lookup,
            interval_seconds=resolve_interval_seconds,
        )
        self._follow_addresses(self._addresses.addresses)
        self._addresses.start_looking_up()

    def _follow_addresses(self, addresses: Sequence[Address]) -> None:
        """Open a channel to each new address, take the gone ones out of turn at once
        and close them once their calls in flight are answered."""
        for address in addresses:
            if address.name not in self._channels:
                channel = open_channel(address.name, self._tls, address.authority)
                self._channels[address.name] = channel
                self.coalescers[address.name] = self._coalescer(
                    address.name, channel, self._coalescing, self._metrics
                )
        self.replicas = tuple(address.name for address in addresses)
        self.outliers.track(self.replicas)
        for name in [name for name in self._channels if name not in self.replicas]:
            # NOTE: pick() and classify() look a replica up in the same loop turn, so
            # no call can reach a coalescer after it leaves these dicts.
            self.loads.pop(name, None)
            retired = self._retire(self.coalescers.pop(name), self._channels.pop(name))
            task = asyncio.get_running_loop().create_task(retired)
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    @staticmethod
    async def _retire(coalescer: ReplicaCoalescer, channel: grpc.aio.Channel) -> None:
        await coalescer.close()
        await channel.close()

    def _coalescer(
        self,
        target: str,
        channel: grpc.aio.Channel,
        settings: CoalescingSettings,
        metrics: UpstreamMetrics | None,
    ) -> ReplicaCoalescer:
        name = self.backend.name
        return ReplicaCoalescer(
            channel,
            backend=name,
            target=target,
            credentials=self._credentials,
            settings=settings,
            on_sent=(lambda n: None) if metrics is None else metrics.items_per_call(name).observe,
            on_expired=(lambda: None) if metrics is None else metrics.expired_unsent(name).inc,
            on_unreachable=self._count_unreachable,
            on_answered=partial(self.outliers.record_success, target),
            on_no_answer=partial(self.outliers.record_failure, target),
            on_load=partial(self._record_load, target),
            predicted_wait=partial(self.predicted_wait, target),
            replica_batch_size=partial(self.replica_batch_size, target),
            replica_queue_capacity=partial(self.replica_queue_capacity, target),
            retry_after=self.retry_after_seconds,
        )

    def model_service(self, target: str) -> model_pb_grpc.ModelServiceAsyncStub:
        """The operator API of one replica, over the same channel as its calls."""
        return model_pb_grpc.ModelServiceStub(self._channels[target])

    @property
    def credentials(self) -> tuple[tuple[str, str], ...]:
        """Metadata that authenticates the orchestrator to capability servers."""
        return self._credentials

    def pick(self, avoid: Collection[str] = (), time_left: float | None = None) -> str:
        """The replica with the fewest items outstanding (sent and not answered, or
        gathering), the first in turn on a tie, among those not ejected, not failing
        their connection, not in `avoid` (already tried), and whose reported wait fits
        the time the call may take (the backend's timeout, or `time_left` seconds less
        the answer's margin; None: any), if there is one; else one of those whose wait
        does not fit; else one tried before; else an ejected one not tried whose
        connection is not failing; else the next in turn.

        A replica whose report says it cannot answer in time refuses such a call
        unsent; it then had nothing outstanding, and so took nearly every call, and
        refused it, while the replica beside it stood idle.

        Fewest outstanding, not plain turns: a replica that has stopped answering
        without closing its connections (a stopped process) holds its calls until
        their deadlines, and in turn it would get its share of every call meanwhile.
        """
        replicas = self.replicas
        if len(replicas) == 1:  # the common case: nothing to choose
            return replicas[0]
        is_ejected = self.outliers.is_ejected
        channels, coalescers = self._channels, self.coalescers
        self._turn = start = (self._turn + 1) % len(replicas)
        best: str | None = None
        # Else one whose report says it is short of time (refused unsent, at no cost),
        # before one already tried (a hung one would spend the fallback's time).
        slow: str | None = None
        fallback: str | None = None
        # Else one ejected but connected, before one whose connection fails: a replica
        # that went down while the other was still ejected (a rolling restart, the
        # other just back) cannot be ejected itself (never all), and in turn it took
        # every other call, each failing at once.
        ejected: str | None = None
        least = math.inf
        bound = (
            None
            if time_left is None
            else min(self.backend.timeout_seconds, time_left - DEADLINE_SAFETY_MARGIN_SECONDS)
        )
        for offset in range(len(replicas)):
            target = replicas[(start + offset) % len(replicas)]
            if channels[target].get_state() is _FAILING:
                continue
            if is_ejected(target):
                if target not in avoid:
                    ejected = ejected or target
                continue
            if target in avoid:
                fallback = fallback or target
                continue
            if bound is not None and self.predicted_wait(target) > bound:
                slow = slow or target
                continue
            outstanding = coalescers[target].outstanding
            if outstanding < least:
                best, least = target, outstanding
                if outstanding == 0:
                    break
        return best or slow or fallback or ejected or replicas[start]

    def has_untried(self, tried: Collection[str]) -> bool:
        """Whether `pick(avoid=tried)` would choose a replica not in `tried`: one not
        ejected and not failing its connection, whatever its report says (refused
        unsent, it costs nothing, and the refusal may go to the fallback). Counting
        every replica, a retry after a time-out went back to the hung one while the
        other was ejected or down, and the fallback, whose time it spent, never
        answered. An ejected replica counts only where every replica tried is failing
        its connection, as in pick(): a call that failed at once on a replica gone down
        is retried on one still ejected rather than failed, while one that timed out
        on a hung replica is not (its retry would spend the fallback's time)."""
        is_ejected = self.outliers.is_ejected
        connected = [
            target for target in self.replicas if self._channels[target].get_state() is not _FAILING
        ]
        if any(target not in tried and not is_ejected(target) for target in connected):
            return True
        if any(target in tried and not is_ejected(target) for target in connected):
            return False  # pick() takes one tried before over one ejected
        return any(target not in tried for target in connected)

    def _record_load(self, target: str, raw: bytes) -> ReplicaLoad | None:
        load = read_load_report(raw, asyncio.get_running_loop().time())
        # Not for a replica gone from the name's addresses while its call was in flight:
        # kept, its report outlived it, and a new pod given its address started from it.
        if load is not None and target in self.replicas:
            self.loads[target] = load
        return load

    def predicted_wait(self, target: str) -> float:
        """Seconds a short text sent to `target` now is predicted to take, from its last
        load report (0 before any)."""
        load = self.loads.get(target)
        return 0.0 if load is None else load.wait_at(asyncio.get_running_loop().time())

    def replica_batch_size(self, target: str) -> int:
        """Most texts `target` computes in one batch, from its last load report (0
        before any, or when it does not say)."""
        load = self.loads.get(target)
        return 0 if load is None else load.max_batch_size

    def replica_queue_capacity(self, target: str) -> int:
        """Most texts `target`'s queue for the model holds, from its last load report
        (0 before any, or when it does not say)."""
        load = self.loads.get(target)
        return 0 if load is None else load.queue_capacity

    def _timed_out_first(
        self, timeout: float, client_remaining: float | None, elapsed: float
    ) -> bool:
        """Whether a call given `timeout` (call_timeout's) that ran out after `elapsed`
        seconds ran out on the backend's own timeout with time still left on the
        caller's deadline, rather than on it. (An item may gather for longer than the
        timeout before its call leaves: the caller's deadline is what ends that.)"""
        return timeout == self.backend.timeout_seconds and (
            client_remaining is None
            or client_remaining - DEADLINE_SAFETY_MARGIN_SECONDS
            > max(timeout, elapsed + EXPIRY_RESOLUTION_SECONDS)
        )

    def _refuse_unreachable(self, target: str, timeout: float) -> None:
        """DeadlineUnreachable when the replica's reported wait is longer than the time
        the call may take: sending it would only queue it to miss its deadline."""
        wait = self.predicted_wait(target)
        if wait > timeout:
            self._count_unreachable(UNREACHABLE_REPORTED_WAIT)
            raise DeadlineUnreachable(
                f"backend {self.backend.name} reports a wait of about {wait * 1000:.0f} ms, "
                f"but only {timeout * 1000:.0f} ms are left",
                retry_after_seconds=self.retry_after_seconds(),
                backend=self.backend.name,
                predicted_wait_ms=round(wait * 1000),
                remaining_ms=round(timeout * 1000),
            )

    def retry_after_seconds(self) -> float:
        """When a caller refused for this backend's load should try again."""
        if self.concurrency is not None:
            return self.concurrency.retry_after_seconds()
        return CONCURRENCY_RETRY_AFTER_SECONDS

    def concurrency_limit(self) -> float | None:
        """The limit on calls in flight in force now: the lower of the backend's
        max_concurrency and its adaptive limit; None when it has neither."""
        static = self.max_concurrency
        adaptive = None if self.concurrency is None else self.concurrency.limit
        if static is None:
            return adaptive
        return float(static) if adaptive is None else min(float(static), adaptive)

    def replaces(self, earlier: BackendPool) -> None:
        """This pool serves the backend that `earlier` served before an edit changed it
        (its timeout, its targets): calls still in flight there count here until it
        closes."""
        self._replaced = earlier

    @property
    def calls_in_flight(self) -> int:
        """Calls in flight to the backend: this pool's, and those of the pools it
        replaced that are still open. Without the latter, an edit of a backend with
        max_concurrency let as many calls again reach the same replicas."""
        earlier = self._replaced
        if earlier is not None and earlier._closed:
            earlier = self._replaced = None  # its calls have all ended
        return self.in_flight + (0 if earlier is None else earlier.calls_in_flight)

    def _admit(self) -> None:
        """Take a slot under the backend's limits, or raise ConcurrencyLimited at once:
        refused before any work, and not retried on this backend (its retry would meet
        the same limit), so the fallback takes it at once."""
        limit = self.max_concurrency
        if limit is not None and self.calls_in_flight >= limit:
            self._count_refused_at_max()
            raise ConcurrencyLimited(
                f"backend {self.backend.name} is at its concurrency limit (max_concurrency)",
                retry_after_seconds=CONCURRENCY_RETRY_AFTER_SECONDS,
                backend=self.backend.name,
                limit=limit,
            )
        adaptive = self.concurrency
        if adaptive is not None and not adaptive.try_acquire():
            self._count_refused_at_adaptive()
            raise ConcurrencyLimited(
                f"backend {self.backend.name} has {adaptive.in_flight} calls in flight, "
                f"its adaptive limit",
                retry_after_seconds=adaptive.retry_after_seconds(),
                backend=self.backend.name,
                limit=int(adaptive.limit),
            )
        self.in_flight += 1

    async def classify(
        self,
        request: pb.ClassifyRequest,
        *,
        target: str,
        client_remaining: float | None,
        shadow: bool = False,
    ) -> pb.ClassifyResponse:
        """One attempt on one replica; failures come back as ServiceErrors. Refused at
        once, before any work: past the backend's concurrency limit (ConcurrencyLimited),
        or when the replica's reported wait is longer than the time left
        (DeadlineUnreachable). A `shadow` call takes no slot under the backend's limits
        and teaches the adaptive one nothing: it must never turn away a caller of this
        backend (shadow calls have a cap of their own, --shadow-max-in-flight)."""
        try:
            timeout = call_timeout(self.backend.timeout_seconds, client_remaining)
        except DeadlineUnreachable:
            # Shed like the others, though the caller's short deadline, not the
            # backend's load, is why: the cause tells them apart.
            self._count_unreachable(UNREACHABLE_MARGIN)
            raise
        if client_remaining is not None:
            self._refuse_unreachable(target, timeout)
        if not shadow:
            self._admit()
        started = time.perf_counter()
        latency: float | None = None
        overloaded = False
        try:
            # The capability's result cache answers a tenant only with its own results.
            response = await self.coalescers[target].classify(
                request,
                # It may gather until its caller's deadline (less the margin); the
                # backend's timeout bounds its call from when that leaves.
                seconds=(
                    math.inf
                    if client_remaining is None
                    else client_remaining - DEADLINE_SAFETY_MARGIN_SECONDS
                ),
                call_seconds=timeout,
                trace_metadata=inject_context(),
                cache_scope=cache_scope_of(current_caller().tenant),
            )
            latency = time.perf_counter() - started
            return response
        except DeadlineUnreachable:
            # Refused before any work (by the coalescer's prediction, or the replica's):
            # its reason and RetryInfo stand; it is no timeout of the backend's.
            overloaded = True
            raise
        except DeadlineExpired as expired:
            # Out of time here.
            overloaded = True
            if self._timed_out_first(timeout, client_remaining, time.perf_counter() - started):
                # The one line that names the replica: the translation of the call's
                # DEADLINE_EXCEEDED cannot tell the backend's timeout from the caller's
                # deadline, and logs at DEBUG (classify_common.errors.is_routine_refusal).
                log.warning(
                    "capability call failed",
                    extra={
                        "backend": self.backend.name,
                        "target": target,
                        "code": grpc.StatusCode.DEADLINE_EXCEEDED.name,
                        "details": "no answer within the backend's timeout",
                        "backend_timeout_ms": round(timeout * 1000),
                    },
                )
                raise BackendTimedOut(
                    f"backend {self.backend.name} did not answer within its "
                    f"{timeout * 1000:.0f} ms timeout",
                    backend=self.backend.name,
                    backend_timeout_ms=round(timeout * 1000),
                ) from expired
            raise
        except Overloaded:
            # Refused by the backend for load.
            overloaded = True
            raise
        except asyncio.CancelledError as cancelled:
            # The caller went. At its deadline, the call was answered too late: overload;
            # so was a batch item whose call's answer came due first (ANSWER_DUE, some
            # 70 ms or more before the deadline). Before it (a hedged call's loser, a
            # user's Ctrl-C) it is no news of the backend, and counting it would hold
            # hedging clients to the limit for good.
            overloaded = cancelled_code(cancelled) == grpc.StatusCode.DEADLINE_EXCEEDED
            overloaded = overloaded or cancelled_at_deadline(
                time.perf_counter() - started, client_remaining
            )
            raise
        finally:
            if not shadow:
                self.in_flight -= 1
                if self.concurrency is not None:
                    self.concurrency.release(latency, overloaded=overloaded)

    def hold(self) -> BackendPool:
        """One more route table serves from this pool; it calls `release` when done."""
        self._holders += 1
        return self

    async def release(self) -> None:
        """A route table is done with this pool: the last one closes it."""
        self._holders -= 1
        if self._holders == 0:
            await self.close()

    async def close(self) -> None:
        self._closed = True
        self._replaced = None
        if self._metrics is not None:
            self._metrics.unwatch_concurrency(self.backend.name, self)
        await self._addresses.close()
        for coalescer in self.coalescers.values():
            await coalescer.close()
        for channel in self._channels.values():
            await channel.close()
        await asyncio.gather(*self._retiring)


class UpstreamPools:
    """A BackendPool for every backend in the route table.

    Built for an edit of routes.yaml, it takes over from `carried_from` (the pools of
    the routes in force) every backend the edit left as it was, under the same
    outlier settings: its connections, its adaptive limit, its ejected replicas, its
    replicas' load reports and its coalescers' call-time models carry on. An edit
    made during an incident (a fallback added, a route moved) must not readmit an
    ejected pod, forget an engaged limit, or reconnect every channel at once.
    """

    def __init__(
        self,
        backends: Mapping[str, Backend],
        outliers: OutlierSettings,
        on_ejected: Callable[[Backend, str, float], None] = lambda backend, target, seconds: None,
        internal_token: str | None = None,
        tls: ClientTls | None = None,
        coalescing: CoalescingSettings = DEFAULT_COALESCING,
        metrics: UpstreamMetrics | None = None,
        concurrency: ConcurrencySettings = DEFAULT_CONCURRENCY,
        *,
        carried_from: UpstreamPools | None = None,
    ) -> None:
        self.outliers = outliers
        # Backends whose pools the next routes took over (for the reload's log line).
        self._handed_over: set[str] = set()
        self._pools: dict[str, BackendPool] = {}
        for name, backend in backends.items():
            carried = carried_from.take_over(backend, outliers) if carried_from else None
            if carried is not None:
                self._pools[name] = carried
                continue
            pool = self._pools[name] = BackendPool(
                backend,
                outliers,
                partial(on_ejected, backend),
                internal_token,
                tls,
                coalescing,
                metrics,
                concurrency,
            )
            earlier = carried_from._pools.get(name) if carried_from else None
            if earlier is not None:
                pool.replaces(earlier)

    def take_over(self, backend: Backend, outliers: OutlierSettings) -> BackendPool | None:
        """This pool of `backend`, handed to the next routes, if it is defined exactly
        as before and ejects under the same settings; None otherwise."""
        pool = self._pools.get(backend.name)
        if pool is None or pool.backend != backend or outliers != self.outliers:
            return None
        self._handed_over.add(backend.name)
        return pool.hold()

    @property
    def carried_over(self) -> frozenset[str]:
        """The backends whose pools the next routes took over."""
        return frozenset(self._handed_over)

    def pool(self, backend: Backend) -> BackendPool:
        return self._pools[backend.name]

    def pools(self) -> list[BackendPool]:
        return list(self._pools.values())

    async def close(self) -> None:
        """Let go of every pool; each closes once no route table serves from it (calls
        that began under older routes may still be using one that this table shared)."""
        for pool in self._pools.values():
            await pool.release()
