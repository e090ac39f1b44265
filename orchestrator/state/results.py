"""Results for GetResult in Redis, shared by every orchestrator process that uses it.

The same contract as orchestrator.results.LocalResultStore, with the capacity
and TTL across all processes: holding a result is one script (set the value
with its TTL and its holding call's token, index it, and past the capacity
drop an expired result or the oldest of the tenant holding the most),
finishing one is a script that keeps the TTL and replaces the value only while
it is there and the token is still the finishing call's (a later call with the
same request ID took it over otherwise), and a poll is one GET. A result is
keyed by its tenant and request ID (see result_key), as the local store keeps
it.

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
- get: StateUnavailable (UNAVAILABLE), and the client polls again later.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ai.classify.v1 import classify_service_pb2 as pb
from classify_common.errors import (
    InternalError,
    InvalidRequest,
    ServiceError,
    StateUnavailable,
)
from orchestrator.results import new_hold_token, result_not_found, result_owner
from orchestrator.state.connection import KEY_PREFIX, RedisState

RESULT_PREFIX = KEY_PREFIX + "result:"
# Beside each result, the token of the call holding it (orchestrator.results). A key of
# its own, not a part of the value, so orchestrators of the last version, sharing the
# Redis during a rolling upgrade, still read every value.
RESULT_TOKEN_PREFIX = KEY_PREFIX + "result-token:"
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

log = logging.getLogger(__name__)

# KEYS[1] the result, KEYS[2] the index, KEYS[3] the tenants' counts, KEYS[4] this
# tenant's index, KEYS[5] the result's token. ARGV: index member (result_key), value,
# TTL (ms), capacity, result key prefix, tenant index prefix, tenant, token, token key
# prefix. Server time, so orchestrators' clocks need
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
redis.call('ZADD', KEYS[2], now_ms, ARGV[1])
if redis.call('ZADD', KEYS[4], now_ms, ARGV[1]) == 1 then
  redis.call('ZINCRBY', KEYS[3], 1, ARGV[7])
end
local dropped = 0
while redis.call('ZCARD', KEYS[2]) > tonumber(ARGV[4]) and dropped < 64 do
  local counts = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
  local counted = 0
  for i = 2, #counts, 2 do counted = counted + tonumber(counts[i]) end
  local largest = counts[#counts - 1]
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
    redis.call('DEL', ARGV[5] .. victim, ARGV[9] .. victim)
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


# KEYS[1] the result, KEYS[2] its token; ARGV[1] the finishing call's token, ARGV[2]
# the value. 1: written; 0: the result is gone; -1: a later call holds it. A result
# without a token (held by the last version) is written as that version did.
_FINISH = """
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then
  return -1
end
if redis.call('SET', KEYS[1], ARGV[2], 'XX', 'KEEPTTL') then
  return 1
end
return 0
"""


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`retry_max_seconds`: the longest backoff between tries to store an outcome
        again (--state-retry-seconds)."""
        if capacity < 1 or ttl_seconds <= 0:
            raise ValueError("the result store needs a capacity of 1 or more and a positive TTL")
        self._state = state
        self._capacity = capacity
        self._ttl_ms = int(ttl_seconds * 1000)
        self._ttl_seconds = ttl_seconds
        self._retry_max = retry_max_seconds
        self._clock = clock
        self._hold_script = state.client.register_script(_HOLD)
        self._finish_script = state.client.register_script(_FINISH)
        # By `<tenant>/<request id>`, oldest first; a later outcome of the same name
        # (a later call's) takes the earlier's place.
        self._unstored: dict[str, UnstoredOutcome] = {}
        self._unstored_bytes = 0
        self._storing_again: asyncio.Task[None] | None = None

    async def hold(self, request_id: str, pending: pb.ClassifyResponse) -> str | None:
        tenant = result_owner()
        member = result_key(tenant, request_id)
        keys = [RESULT_PREFIX + member, RESULTS_INDEX, TENANT_COUNTS, TENANT_INDEX_PREFIX + tenant]
        keys.append(RESULT_TOKEN_PREFIX + member)
        value = PENDING + pending.SerializeToString()
        token = new_hold_token()
        args: list[bytes | str | int] = [member, value, self._ttl_ms, self._capacity]
        args += [RESULT_PREFIX, TENANT_INDEX_PREFIX, tenant, token, RESULT_TOKEN_PREFIX]
        try:
            await self._state.run("result_hold", lambda: self._hold_script(keys=keys, args=args))
        except StateUnavailable:
            return None
        return token

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
            [RESULT_PREFIX + member, RESULT_TOKEN_PREFIX + member],
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
            while self._unstored:
                ceiling = min(UNSTORED_RETRY_INITIAL_SECONDS * 2**failed_tries, self._retry_max)
                await asyncio.sleep(random.uniform(0, ceiling))
                if await self._store_unstored_once():
                    failed_tries = 0
                else:
                    failed_tries += 1
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
        are lost (logged)."""
        if self._storing_again is not None:
            self._storing_again.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._storing_again
        if self._unstored and not await self._store_unstored_once():
            log.warning(
                "results not stored at stop: Redis did not take them; polls see "
                "PROCESSING until they expire",
                extra={"request_ids": [outcome.request_id for outcome in self._unstored.values()]},
            )

    async def get(self, request_id: str) -> pb.ClassifyResponse:
        key = RESULT_PREFIX + result_key(result_owner(), request_id)
        client = self._state.client
        value = await self._state.run("result_get", lambda: client.get(key))
        if not isinstance(value, bytes):  # None: not there (the client never decodes)
            raise result_not_found(request_id)
        kind, payload = value[:1], value[1:]
        if kind == ERROR:
            raise decode_error(payload)
        return pb.ClassifyResponse.FromString(payload)


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
        error.violations = ()  # the work behind a stored result was validated before it ran
    return error


def _with_subclasses(cls: type[ServiceError]) -> Iterator[type[ServiceError]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _with_subclasses(sub)


_ERRORS_BY_REASON = {error.reason: error for error in _with_subclasses(ServiceError)}
