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
- finish: the outcome is lost; polls see PROCESSING until the entry expires
  (logged and counted as a failed result_finish);
- get: StateUnavailable (UNAVAILABLE), and the client polls again later.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

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


class RedisResultStore:
    """A ResultStore (orchestrator.results) in Redis."""

    def __init__(self, state: RedisState, capacity: int, ttl_seconds: float) -> None:
        if capacity < 1 or ttl_seconds <= 0:
            raise ValueError("the result store needs a capacity of 1 or more and a positive TTL")
        self._state = state
        self._capacity = capacity
        self._ttl_ms = int(ttl_seconds * 1000)
        self._hold_script = state.client.register_script(_HOLD)
        self._finish_script = state.client.register_script(_FINISH)

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
        keys = [RESULT_PREFIX + member, RESULT_TOKEN_PREFIX + member]
        try:
            written = await self._state.run(
                "result_finish", lambda: self._finish_script(keys=keys, args=[token, value])
            )
        except StateUnavailable:
            log.warning(
                "result not stored; polls see PROCESSING until it expires",
                extra={"request_id": request_id},
            )
            return
        if written == -1:  # a later call with this request ID holds the place: its own
            return
        if not written:  # the result is gone
            log.warning(
                "result not stored: its entry is gone (expired, pushed out past "
                "--results-capacity, or lost by Redis: restarted empty, flushed, evicted)",
                extra={"request_id": request_id},
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
