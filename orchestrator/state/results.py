"""Results for GetResult in Redis, shared by every orchestrator process that uses it.

The same contract as orchestrator.results.LocalResultStore, with the capacity
and TTL across all processes: holding a result is one script (set the value
with its TTL and its holding call's token, index it, and past the capacity
drop an expired result or the oldest of the tenant holding the most),
finishing one is a script that keeps the TTL and replaces the value only while
it is there and the token is still the finishing call's (a later call with the
same request ID took it over otherwise), and a poll is one script that reads
it. A result is keyed by its tenant and request ID (see result_key), as the
local store keeps it.

A process that dies holding results (SIGKILL, the OOM killer) leaves them
PROCESSING with nothing running behind them; no outcome will ever be written.
So a held result also names the process holding it, and each process keeps a
lease in Redis that it renews every quarter of --state-lease-seconds while it runs
(the hold itself starts it): a poll that finds a result still pending whose
process's lease has lapsed (--state-lease-seconds without a renewal) answers
ServerDraining with the result's trace ID, as the entry a graceful stop writes
does: send the call again. Leases are in Redis's clock (TIME in the scripts),
so the orchestrators' clocks need not agree. A renewed lease, not a deadline
for the work: the store is not told how long a route's work may take, and a
renewed lease lets go of a dead process's results sooner than the longest
work would. The local store (orchestrator.results.LocalResultStore) needs
none: a crash loses it with the process, and its polls with it.

When Redis does not answer:
- hold: False, and the dispatcher answers the call when it is done, within the
  client's deadline, instead of PROCESSING (no one could poll for it);
- finish: the outcome is kept in this process and stored again, with backoff
  (gRPC A6's: random(0, min(initial * 2^(n-1), --state-retry-seconds))), not
  held back by the rest after a failure, until Redis takes it or the entry has
  expired; meanwhile polls see PROCESSING. At most MAX_UNSTORED_RESULTS
  outcomes (MAX_UNSTORED_BYTES in all) wait so: past that the oldest is let go
  (logged). A graceful stop tries each once more. Every try is counted as a
  result_finish;
- get: StateUnavailable (UNAVAILABLE), and the client polls again later; a poll
  whose deadline comes before --state-timeout-ms waits for Redis until 30 ms
  before it (connection.DEADLINE_MARGIN_SECONDS), and is answered in time;
- the lease: not renewed, and tried again every PROCESS_LEASE_RETRY_SECONDS.
  After an outage longer than the lease, a poll in the moments (up to that
  retry) before a process's lease is back may answer ServerDraining for work
  still running: the call is sent again and computed twice, never answered
  wrongly (the earlier call's outcome does not replace the later's, see
  orchestrator.results).

A graceful stop ends the process's lease (after its last try at storing the
outcomes it kept), so polls for any result it still held answer ServerDraining
at once.

Orchestrators of the last version sharing the Redis (a rolling upgrade) read
every value this one writes: the values are as they were, and who holds a
result is in keys of its own, which they neither read nor write. Their pending
results name no process, so polls answer them PROCESSING until the TTL, as
that version did; the result-process key names the holding call's token, so
one that an older orchestrator held again under the same request ID is not
taken for this one's.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ai.classify.v1 import classify_service_pb2 as pb
from classify_common.context import time_left
from classify_common.errors import (
    FieldViolation,
    InternalError,
    InvalidRequest,
    ResultNotFound,
    ServerDraining,
    ServiceError,
    StateUnavailable,
)
from orchestrator.results import new_hold_token, result_not_found, result_owner
from orchestrator.state.connection import KEY_PREFIX, RedisState, StateFailed

RESULT_PREFIX = KEY_PREFIX + "result:"
# Beside each result, the token of the call holding it (orchestrator.results). A key of
# its own, not a part of the value, so orchestrators of the last version, sharing the
# Redis during a rolling upgrade, still read every value.
RESULT_TOKEN_PREFIX = KEY_PREFIX + "result-token:"
# Beside each result held by this version: "<token> <process>", the holding call's token
# and the ID of the process it runs in (process_id()). A key of its own, for the same
# reason as the token's.
RESULT_PROCESS_PREFIX = KEY_PREFIX + "result-process:"
# One per process that holds results: the Redis time (ms) its lease runs to. It expires
# with the results TTL, not with the lease, so under maxmemory it is evicted no sooner
# than the results that name it (docs/deploy.md: every key expires).
PROCESS_LEASE_PREFIX = KEY_PREFIX + "process-lease:"
RESULTS_INDEX = KEY_PREFIX + "results"
TENANT_COUNTS = KEY_PREFIX + "results-by-tenant"
TENANT_INDEX_PREFIX = KEY_PREFIX + "results:"
# The first byte of a stored value says what follows it.
PENDING, DONE, ERROR = b"P", b"D", b"E"

# Outcomes that Redis did not take, kept to store again: at most this many, and this
# many bytes of values in all (the oldest goes first past either). A value is one
# serialized response, a few hundred bytes to a few KiB.
MAX_UNSTORED_RESULTS = 10_000
MAX_UNSTORED_BYTES = 64 * 1024 * 1024
# First retry's backoff ceiling (s); it doubles per failed try up to --state-retry-seconds.
UNSTORED_RETRY_INITIAL_SECONDS = 0.05


def backoff_ceiling(failed_tries: int, longest: float) -> float:
    """The longest wait before the next try after `failed_tries` failed in a row: the
    first wait's ceiling doubled per failure, up to `longest`.

    NOTE: the doublings stop at 30 (0.05 s x 2^30 is over a year): uncapped, 2**n grew
    with the outage, and past about 1,024 failed tries the float overflowed, which
    ended the task and left the kept outcomes never stored."""
    doubled: float = UNSTORED_RETRY_INITIAL_SECONDS * 2 ** min(failed_tries, 30)
    return min(doubled, longest)


# A process's lease on the results it holds is renewed every quarter of it
# (--state-lease-seconds, 10 s by default), so three renewals in a row may fail (a Redis
# blip, a stalled event loop) before polls give up on its results. A dead process's
# results answer "send again" at most the lease after it died.
PROCESS_LEASE_RENEWALS = 4
# After a renewal failed, the next try comes this soon.
PROCESS_LEASE_RETRY_SECONDS = 0.25

log = logging.getLogger(__name__)

# KEYS[1] the result, KEYS[2] the index, KEYS[3] the tenants' counts, KEYS[4] this
# tenant's index, KEYS[5] the result's token, KEYS[6] the result's process, KEYS[7] the
# holding process's lease. ARGV: index member (result_key), value, TTL (ms), capacity,
# result key prefix, tenant index prefix, tenant, token, token key prefix, result process
# key prefix, process ID, lease (ms). Server time, so orchestrators' clocks need
# not agree. Expired members leave every index first; past the capacity, the oldest
# result of the tenant holding the most goes (orchestrator.results says why).
# NOTE: the keys of other tenants and of dropped results are built here, not passed in
# KEYS: fine on one Redis server (or a primary with replicas), not on Redis Cluster.
_HOLD = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local ttl_ms = tonumber(ARGV[3])
-- A member leaves both indexes and its tenant's count. NOTE: a tenant's own index
-- expires with its last result, before the pass below takes that result out of the
-- shared index: the count goes down whichever index still held the member.
local function forget(member, tenant)
  local held = redis.call('ZREM', KEYS[2], member) + redis.call('ZREM', ARGV[6] .. tenant, member)
  if held > 0 and tonumber(redis.call('ZINCRBY', KEYS[3], -1, tenant)) <= 0 then
    redis.call('ZREM', KEYS[3], tenant)
  end
end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_ms - ttl_ms)) do
  forget(member, string.match(member, '^(.*)/[^/]*$'))
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ttl_ms)
redis.call('SET', KEYS[5], ARGV[8], 'PX', ttl_ms)
redis.call('SET', KEYS[6], ARGV[8] .. ' ' .. ARGV[11], 'PX', ttl_ms)
redis.call('SET', KEYS[7], string.format('%d', now_ms + tonumber(ARGV[12])), 'PX', ttl_ms)
redis.call('ZADD', KEYS[2], now_ms, ARGV[1])
if redis.call('ZADD', KEYS[4], now_ms, ARGV[1]) == 1 then
  redis.call('ZINCRBY', KEYS[3], 1, ARGV[7])
end
local dropped = 0
while redis.call('ZCARD', KEYS[2]) > tonumber(ARGV[4]) and dropped < 64 do
  local counts = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
  local counted, most = 0, 0
  for i = 2, #counts, 2 do
    counted = counted + tonumber(counts[i])
    most = math.max(most, tonumber(counts[i]))
  end
  -- Of the tenants holding the most, the one whose oldest result is oldest (one that
  -- holds none in its index first, to clear its count). By name, the tenant last in
  -- the alphabet lost every tie, and a result held this moment could be the one
  -- dropped, its caller told PROCESSING for a result already gone.
  local largest, oldest
  for i = 1, #counts, 2 do
    if tonumber(counts[i + 1]) == most then
      local first = redis.call('ZRANGE', ARGV[6] .. counts[i], 0, 0, 'WITHSCORES')
      if not first[2] then
        largest = counts[i]
        break
      end
      if not oldest or tonumber(first[2]) < oldest then
        largest, oldest = counts[i], tonumber(first[2])
      end
    end
  end
  local victim, owner
  if redis.call('ZCARD', KEYS[2]) > counted or not largest then
    -- results an older version held are in no tenant's index: the oldest goes
    victim = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
    owner = string.match(victim, '^(.*)/[^/]*$')
  else
    victim, owner = redis.call('ZRANGE', ARGV[6] .. largest, 0, 0)[1], largest
  end
  if victim then
    forget(victim, owner)
    redis.call('DEL', ARGV[5] .. victim, ARGV[9] .. victim, ARGV[10] .. victim)
  else  -- counted but holding none (indexes an older version left)
    redis.call('ZREM', KEYS[3], largest)
  end
  dropped = dropped + 1
end
redis.call('PEXPIRE', KEYS[2], ttl_ms)
redis.call('PEXPIRE', KEYS[3], ttl_ms)
redis.call('PEXPIRE', KEYS[4], ttl_ms)
return dropped
"""


# KEYS[1] the result, KEYS[2] its token, KEYS[3] its process; ARGV[1] the finishing
# call's token, ARGV[2] the value. 1: written; 0: the result is gone; -1: a later call
# holds it. A result without a token (held by the last version) is written as that
# version did. Written, it names no process any more: an orchestrator from before the
# hold tokens, holding the same request ID again, writes no token, and the token and
# process keys left here would still match, and give its live work up once this
# process's lease lapsed. (The last version passes two keys: no process to forget.)
_FINISH = """
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then
  return -1
end
if redis.call('SET', KEYS[1], ARGV[2], 'XX', 'KEEPTTL') then
  if KEYS[3] then
    redis.call('DEL', KEYS[3])
  end
  return 1
end
return 0
"""


# KEYS[1] this process's lease; ARGV[1] the lease (ms), ARGV[2] the results TTL (ms).
_RENEW_LEASE = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('SET', KEYS[1], string.format('%d', now_ms + tonumber(ARGV[1])), 'PX', ARGV[2])
"""


# KEYS[1] the result, KEYS[2] its token, KEYS[3] its process; ARGV[1] the process lease
# key prefix. NOTE: the lease key is built here, not passed in (as _HOLD builds other
# tenants' keys): not for Redis Cluster. The value (nil: not there); or {value,
# process} for a pending result whose process's lease has lapsed. A pending result
# without a process (held by the last version), or whose token is not the holding
# call's (an older version held it again), is the value: the TTL alone bounds it.
_GET = """
local value = redis.call('GET', KEYS[1])
if not value or string.sub(value, 1, 1) ~= 'P' then
  return value
end
local held = redis.call('GET', KEYS[3])
if not held then
  return value
end
local token, process = string.match(held, '^(%S+) (.+)$')
if not token or token ~= redis.call('GET', KEYS[2]) then
  return value
end
local lease = redis.call('GET', ARGV[1] .. process)
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
if lease and tonumber(lease) > now_ms then
  return value
end
return {value, process}
"""


def process_id() -> str:
    """`<host>:<pid>:<random>`: this process, in the keys that say who holds a result.
    The random part tells a restarted process (a new worker, a container restarted
    with the same pid) from the one that died."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


@dataclass(frozen=True)
class UnstoredOutcome:
    """A finished call's outcome that Redis did not take, waiting to be stored again."""

    request_id: str
    keys: list[str]  # the result's and its token's (the tenant is in them)
    token: str
    value: bytes
    give_up_at: float  # monotonic seconds: the held entry has expired by then


class RedisResultStore:
    """A ResultStore (orchestrator.results) in Redis."""

    def __init__(
        self,
        state: RedisState,
        capacity: int,
        ttl_seconds: float,
        *,
        retry_max_seconds: float = 1.0,
        lease_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`retry_max_seconds`: the longest backoff between tries to store an outcome
        again (--state-retry-seconds); `lease_seconds`: this process's lease on the
        results it holds (--state-lease-seconds)."""
        if capacity < 1 or ttl_seconds <= 0:
            raise ValueError("the result store needs a capacity of 1 or more and a positive TTL")
        self._state = state
        # A hold is one command, which run() gives up on after this long.
        self.hold_seconds = state.timeout_seconds
        self._capacity = capacity
        self._ttl_ms = int(ttl_seconds * 1000)
        self._ttl_seconds = ttl_seconds
        self._retry_max = retry_max_seconds
        self._clock = clock
        self._hold_script = state.register_script(_HOLD)
        self._finish_script = state.register_script(_FINISH)
        self._renew_lease_script = state.register_script(_RENEW_LEASE)
        self._get_script = state.register_script(_GET)
        self.process_id = process_id()
        self._lease_ms = int(lease_seconds * 1000)
        self._lease_renew_seconds = lease_seconds / PROCESS_LEASE_RENEWALS
        self._renewing_lease: asyncio.Task[None] | None = None
        self._closed = False
        # By `<tenant>/<request id>`, oldest first; a later outcome of the same name
        # (a later call's) takes the earlier's place.
        self._unstored: dict[str, UnstoredOutcome] = {}
        self._unstored_bytes = 0
        self._storing_again: asyncio.Task[None] | None = None

    async def hold(self, request_id: str, pending: pb.ClassifyResponse) -> str | None:
        tenant = result_owner()
        member = result_key(tenant, request_id)
        keys = [RESULT_PREFIX + member, RESULTS_INDEX, TENANT_COUNTS, TENANT_INDEX_PREFIX + tenant]
        keys += [RESULT_TOKEN_PREFIX + member, RESULT_PROCESS_PREFIX + member]
        keys.append(PROCESS_LEASE_PREFIX + self.process_id)
        value = PENDING + pending.SerializeToString()
        token = new_hold_token()
        args: list[bytes | str | int] = [member, value, self._ttl_ms, self._capacity]
        args += [RESULT_PREFIX, TENANT_INDEX_PREFIX, tenant, token, RESULT_TOKEN_PREFIX]
        args += [RESULT_PROCESS_PREFIX, self.process_id, self._lease_ms]
        try:
            await self._state.run("result_hold", lambda: self._hold_script(keys=keys, args=args))
        except StateFailed:
            # Redis may have run the hold and its answer been lost (a timeout): the place
            # would answer PROCESSING until it expired, filled by no one, while the
            # caller is answered directly. Marked not kept, as a call answered at once
            # is (stored again later while Redis is away; a hold that never ran leaves
            # nothing for it to mark).
            await self.finish(request_id, token, error=_answered_directly(request_id))
            return None
        except StateUnavailable:  # not asked: nothing was held
            return None
        self._start_renewing_lease_if_needed()
        return token

    def _start_renewing_lease_if_needed(self) -> None:
        """Renew this process's lease from now until close(): the hold wrote it, and
        the process's results are polled as its own for as long as it stays renewed."""
        if self._renewing_lease is None and not self._closed:
            # NOTE: in a context of its own, as the task storing outcomes again is.
            self._renewing_lease = asyncio.get_running_loop().create_task(
                self._renew_lease_until_closed(),
                name="results-renew-lease",
                context=contextvars.Context(),
            )

    async def _renew_lease_until_closed(self) -> None:
        keys = [PROCESS_LEASE_PREFIX + self.process_id]
        args = [self._lease_ms, self._ttl_ms]
        wait = self._lease_renew_seconds
        while not self._closed:  # not only until cancelled (RedisState._raise_if_cancelled)
            await asyncio.sleep(wait)
            # Sent even while Redis rests after a failure, as the probe is, and tried
            # again soon after a failure: once Redis answers again after an outage
            # longer than the lease, every process's lease has lapsed, and until each
            # is renewed polls answer "send again" for work still running.
            try:
                await self._state.run(
                    "result_lease",
                    lambda: self._renew_lease_script(keys=keys, args=args),
                    skip_while_resting=False,
                )
            except StateUnavailable:  # counted
                wait = PROCESS_LEASE_RETRY_SECONDS
            except Exception:  # a bug: log it; the lease must go on
                log.exception("renewing the results lease failed unexpectedly")
                wait = PROCESS_LEASE_RETRY_SECONDS
            else:
                wait = self._lease_renew_seconds

    async def finish(
        self,
        request_id: str,
        token: str,
        response: pb.ClassifyResponse | None = None,
        error: ServiceError | None = None,
    ) -> None:
        if error is not None:
            value = ERROR + encode_error(error)
        else:
            assert response is not None, "finish needs a response or an error"
            value = DONE + response.SerializeToString()
        member = result_key(result_owner(), request_id)
        outcome = UnstoredOutcome(
            request_id,
            [RESULT_PREFIX + member, RESULT_TOKEN_PREFIX + member, RESULT_PROCESS_PREFIX + member],
            token,
            value,
            give_up_at=self._clock() + self._ttl_seconds,
        )
        try:
            await self._store(outcome, skip_while_resting=True)
        except StateUnavailable:
            self._keep_unstored(member, outcome)

    async def _store(self, outcome: UnstoredOutcome, *, skip_while_resting: bool) -> None:
        """One try at writing `outcome` into its held entry; StateUnavailable when Redis
        did not take it."""
        written = await self._state.run(
            "result_finish",
            lambda: self._finish_script(keys=outcome.keys, args=[outcome.token, outcome.value]),
            skip_while_resting=skip_while_resting,
        )
        if written == -1:  # a later call with this request ID holds the place: its own
            return
        if not written:  # the result is gone
            log.warning(
                "result not stored: its entry is gone (expired, pushed out past "
                "--results-capacity, or lost by Redis: restarted empty, flushed, evicted)",
                extra={"request_id": outcome.request_id},
            )

    def _keep_unstored(self, member: str, outcome: UnstoredOutcome) -> None:
        """Keep `outcome` to store again (see the module docstring), within the bounds."""
        log.warning(
            "result not stored yet; trying again until it expires (polls see PROCESSING)",
            extra={"request_id": outcome.request_id},
        )
        replaced = self._unstored.pop(member, None)
        if replaced is not None:
            self._unstored_bytes -= len(replaced.value)
        self._unstored[member] = outcome
        self._unstored_bytes += len(outcome.value)
        while len(self._unstored) > MAX_UNSTORED_RESULTS or (
            self._unstored_bytes > MAX_UNSTORED_BYTES and len(self._unstored) > 1
        ):
            oldest = self._unstored.pop(next(iter(self._unstored)))
            self._unstored_bytes -= len(oldest.value)
            log.warning(
                "result not stored: too many results wait to be stored again; polls see "
                "PROCESSING until it expires",
                extra={"request_id": oldest.request_id},
            )
        if self._storing_again is None:
            # NOTE: in a context of its own, not the call's that failed first: the task
            # outlives that call and stores other tenants' outcomes.
            self._storing_again = asyncio.get_running_loop().create_task(
                self._store_again_with_backoff(),
                name="results-store-again",
                context=contextvars.Context(),
            )

    @property
    def unstored(self) -> int:
        """Outcomes waiting to be stored again."""
        return len(self._unstored)

    async def _store_again_with_backoff(self) -> None:
        """The one task that stores kept outcomes again, until none is left."""
        failed_tries = 0
        try:
            while self._unstored and not self._closed:
                ceiling = backoff_ceiling(failed_tries, self._retry_max)
                await asyncio.sleep(random.uniform(0, ceiling))
                try:
                    stored = await self._store_unstored_once()
                except Exception:  # a bug: log it, and keep the outcomes and the task
                    log.exception("storing kept results again failed unexpectedly")
                    stored = False
                failed_tries = 0 if stored else failed_tries + 1
        finally:
            self._storing_again = None

    async def _store_unstored_once(self) -> bool:
        """Try each kept outcome, oldest first, until Redis fails one; False if it did."""
        for member, outcome in list(self._unstored.items()):
            if self._clock() >= outcome.give_up_at:
                log.warning(
                    "result not stored: its entry expired while Redis did not take it",
                    extra={"request_id": outcome.request_id},
                )
            else:
                try:
                    await self._store(outcome, skip_while_resting=False)
                except StateUnavailable:
                    return False
                log.info("result stored on a later try", extra={"request_id": outcome.request_id})
            # A later outcome of the same name may have taken its place meanwhile.
            if self._unstored.get(member) is outcome:
                del self._unstored[member]
                self._unstored_bytes -= len(outcome.value)
        return True

    async def close(self) -> None:
        """At a graceful stop: one more try for each outcome still kept; the rest
        are lost (logged), and the lease ends, so polls stop waiting for them."""
        self._closed = True  # a hold after this one (none is expected) starts no renewal
        leased = self._renewing_lease is not None
        if self._renewing_lease is not None:
            self._renewing_lease.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewing_lease
            self._renewing_lease = None
        if self._storing_again is not None:
            self._storing_again.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._storing_again
        if self._unstored and not await self._store_unstored_once():
            log.warning(
                "results not stored at stop: Redis did not take them; polls are "
                "answered to send the calls again",
                extra={"request_ids": [outcome.request_id for outcome in self._unstored.values()]},
            )
        if leased:
            # Ended now, not the lease later: any result still pending here
            # has nothing running behind it any more.
            lease = PROCESS_LEASE_PREFIX + self.process_id
            with contextlib.suppress(StateUnavailable):
                await self._state.run(
                    "result_lease",
                    lambda: self._state.client.delete(lease),
                    skip_while_resting=False,
                )

    async def get(self, request_id: str) -> pb.ClassifyResponse:
        member = result_key(result_owner(), request_id)
        keys = [
            RESULT_PREFIX + member,
            RESULT_TOKEN_PREFIX + member,
            RESULT_PROCESS_PREFIX + member,
        ]
        args = [PROCESS_LEASE_PREFIX]
        # Within the poll's deadline, as a rate-limit check: cancelled at the deadline
        # instead, the read of a stalled Redis went uncounted, started no rest, and
        # the poller got a bare DEADLINE_EXCEEDED, no IDs, no retry hint.
        answer = await self._state.run(
            "result_get", lambda: self._get_script(keys=keys, args=args), within=time_left()
        )
        lapsed_process = None
        if isinstance(answer, list):  # pending, and its process's lease has lapsed
            value, lapsed_process = answer
        else:
            value = answer
        if not isinstance(value, bytes):  # None: not there (the client never decodes)
            raise result_not_found(request_id)
        kind, payload = value[:1], value[1:]
        if kind == ERROR:
            raise decode_error(payload)
        pending_or_done = pb.ClassifyResponse.FromString(payload)
        # This process's own results are never given up on here: it runs their work,
        # and its lease lapsed only because Redis did not take the renewals.
        if lapsed_process is not None and lapsed_process.decode() != self.process_id:
            raise self._abandoned(request_id, lapsed_process.decode(), pending_or_done)
        return pending_or_done

    @staticmethod
    def _abandoned(request_id: str, process: str, pending: pb.ClassifyResponse) -> ServerDraining:
        """The answer to a poll for a result whose process died holding it: as the
        entry a graceful stop writes (orchestrator.dispatch), send the call again."""
        log.warning(
            "result given up: the orchestrator process holding it stopped renewing its "
            "lease (killed, or stalled); polls are told to send the call again",
            extra={"request_id": request_id, "holding_process": process},
        )
        return ServerDraining(
            "the orchestrator process running this call stopped before it finished; "
            "send the call again",
            result_trace_id=pending.trace_id,
        )


def result_key(tenant: str, request_id: str) -> str:
    """`<tenant>/<request id>`: a result's name in Redis (after RESULT_PREFIX) and in the
    index. One name per pair, whatever the tenant's name holds: a request ID has no '/'
    (the contract's pattern), so the last '/' ends the tenant."""
    return f"{tenant}/{request_id}"


def encode_error(error: ServiceError) -> bytes:
    """What a client would learn of `error`: its reason, message, context, retry hint."""
    fields: dict[str, object] = {
        "reason": error.reason,
        "message": error.message,
        "context": error.context,
    }
    if hasattr(error, "retry_after_seconds"):  # an overload's hint (may be None)
        fields["retry_after_seconds"] = error.retry_after_seconds
    if isinstance(error, InvalidRequest):  # a model's refusal of the text (UnreadableText)
        fields["violations"] = [[v.field, v.rule, v.message] for v in error.violations]
    return json.dumps(fields).encode()


def decode_error(payload: bytes) -> ServiceError:
    """The error `encode_error` stored, as the class its reason names (so it maps to the
    same status); an unknown reason (a newer orchestrator's) is an InternalError."""
    fields = json.loads(payload)
    cls: type[ServiceError] = _ERRORS_BY_REASON.get(fields["reason"], InternalError)
    # NOTE: built without the class's __init__, whose arguments differ by class (a
    # field violation list, a retry hint); ServiceError's takes what every one has.
    error: ServiceError = cls.__new__(cls)
    ServiceError.__init__(error, str(fields["message"]), **fields["context"])
    if "retry_after_seconds" in fields:
        setattr(error, "retry_after_seconds", fields["retry_after_seconds"])  # noqa: B010
    if isinstance(error, InvalidRequest):
        error.violations = tuple(FieldViolation(*v) for v in fields.get("violations", ()))
    return error


def _with_subclasses(cls: type[ServiceError]) -> Iterator[type[ServiceError]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _with_subclasses(sub)


_ERRORS_BY_REASON = {error.reason: error for error in _with_subclasses(ServiceError)}


def _answered_directly(request_id: str) -> ResultNotFound:
    """What a poll learns of a call whose place in the store may have been held, but
    whose holding failed: the call was answered when its work ended, and nothing kept."""
    return ResultNotFound(
        "no result is kept for this request ID: its call was answered directly "
        "(the result store failed as its place was held)",
        request_id=request_id,
    )
