"""When to try a call again, and how long to wait: gRPC's A6 retry design, with the
server's pushback.

A call is retried only for the codes the service marks retryable
(UNAVAILABLE, RESOURCE_EXHAUSTED), and not when retrying cannot help:
RESOURCE_EXHAUSTED without a RetryInfo (every overload refusal of this service
has one; gRPC's own "message larger than max" has none), a negative RetryInfo
(A6: the server says do not retry), or a stored outcome (a GetResult of a
result that failed, which names its trace in `result_trace_id`).
`max_attempts` counts the first try, as A6's `maxAttempts` does. Before
attempt n+1 the client waits:

- the server's google.rpc.RetryInfo delay where the error carries one (its
  pushback), never less, plus up to `pushback_jitter` of it more so that many
  refused callers do not return at the same instant; a delay over
  MAX_RETRY_INFO_SECONDS is not waited for, even without a deadline: the error
  is raised, its `retry_after_seconds` saying when to come back;
- else `random(0, min(initial_backoff * multiplier**(n-1), max_backoff))`.

A retry that follows a connection-level UNAVAILABLE (no ErrorInfo: gRPC itself
found no server to send to, say while the front door restarts) is sent with
`wait_for_ready`, so it waits for the channel to connect again, within the
call's deadline: sent fail-fast, every retry failed at once inside gRPC's own
reconnect backoff and never reached the network. A call without a deadline
keeps retrying fail-fast, so that no call waits for ever on a server that is gone.

The call's deadline bounds everything: a retry (or a GetResult poll) is made
only if, after its wait, at least MIN_SECONDS_FOR_A_CALL are left; else the
last error is raised. A call sent with less could not be answered (the server
keeps 20 ms to send an answer), and the front door counts calls that reach it
with under 10 ms left against the tenant (FRONT_DOOR_BUSY). The error raised
names how many attempts were made and carries the earlier ones' errors
(`ClassifyError.attempts`, `attempt_errors`).

While a Classify answer is PROCESSING, `PollPolicy` spaces the GetResult polls:
the service sends no poll interval, so the client starts at
`initial_interval` and grows it by `multiplier` up to `max_interval`. Neither
policy waits longer than MAX_POLICY_WAIT_SECONDS between two tries or two polls.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from classify_client.errors import RESULT_TRACE_ID, ClassifyError

# The least time a retry or a poll must have left once sent (see the module docstring).
MIN_SECONDS_FOR_A_CALL = 0.05
# The longest timeout a call takes, seconds: one year. NOTE: gRPC turns a timeout into
# an absolute deadline in int64 nanoseconds, which overflows past about 7.4e9 s from
# now, and such a call then ends at once with DEADLINE_EXCEEDED. None is no deadline.
MAX_TIMEOUT_SECONDS = 365 * 24 * 3600
# The longest server RetryInfo delay the client waits out, seconds: one hour. A longer one
# is the caller's to decide on (the error says it): waited without a deadline, it slept
# hours, or (past about 9e9 s) time.sleep raised OverflowError.
MAX_RETRY_INFO_SECONDS = 3600.0
# The longest wait a policy of the client's own may set between two tries or two polls
# (max_backoff_seconds, max_interval_seconds), seconds: as long as the longest server
# delay it waits out. Unbounded, a call without a deadline slept hours, or (past about
# 9.2e9 s, threading.TIMEOUT_MAX) the sync client's wait raised OverflowError.
MAX_POLICY_WAIT_SECONDS = MAX_RETRY_INFO_SECONDS
# A6 defaults a client may keep: 4 tries in all, 0.1 s growing to 5 s.
DEFAULT_MAX_ATTEMPTS = 4
DEFAULT_INITIAL_BACKOFF_SECONDS = 0.1
DEFAULT_MAX_BACKOFF_SECONDS = 5.0
DEFAULT_BACKOFF_MULTIPLIER = 2.0
# Up to this share of the server's delay is added on top of it.
DEFAULT_PUSHBACK_JITTER = 0.2
# The service's retryable codes (docs/api.md#errors).
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})

# GetResult polling: 50 ms growing by half each poll to at most 1 s.
DEFAULT_POLL_INITIAL_SECONDS = 0.05
DEFAULT_POLL_MAX_SECONDS = 1.0
DEFAULT_POLL_MULTIPLIER = 1.5


def refuse_non_finite(policy: object) -> None:
    """Refuse a policy with a float field that is NaN or infinite, naming the field: NaN
    passes every comparison its bounds are checked with, and either one then failed
    the first retry inside time.sleep (ValueError, OverflowError) or made a retry
    never happen, without a word."""
    for setting in dataclasses.fields(policy):  # type: ignore[arg-type]
        value = getattr(policy, setting.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{setting.name} {value!r} must be a finite number")


def refuse_longer_than_the_client_waits(name: str, seconds: float) -> None:
    """Refuse a policy's longest wait over MAX_POLICY_WAIT_SECONDS, naming the field."""
    if seconds > MAX_POLICY_WAIT_SECONDS:
        raise ValueError(
            f"{name} {seconds!r} must be at most {MAX_POLICY_WAIT_SECONDS:g} seconds "
            "(one hour, the longest server RetryInfo delay the client waits out)"
        )


@dataclass(frozen=True)
class RetryPolicy:
    """How often and when a failed call is tried again."""

    # Tries in all, the first included; 1 means never retry. 1 to 10.
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    # Backoff cap before the first retry, seconds, > 0 (used without pushback).
    initial_backoff_seconds: float = DEFAULT_INITIAL_BACKOFF_SECONDS
    # Backoff cap's ceiling, seconds, >= initial_backoff_seconds, <= MAX_POLICY_WAIT_SECONDS.
    max_backoff_seconds: float = DEFAULT_MAX_BACKOFF_SECONDS
    # Growth of the backoff cap per retry, >= 1.
    multiplier: float = DEFAULT_BACKOFF_MULTIPLIER
    # Extra wait after the server's RetryInfo delay, as a share of it, 0 to 1.
    pushback_jitter: float = DEFAULT_PUSHBACK_JITTER
    retryable_codes: frozenset[grpc.StatusCode] = RETRYABLE_CODES
    # Source of randomness in [0, 1); tests may pass a fixed one.
    random: Callable[[], float] = field(default=random.random, repr=False, compare=False)

    def __post_init__(self) -> None:
        refuse_non_finite(self)
        if not 1 <= self.max_attempts <= 10:
            raise ValueError(f"max_attempts {self.max_attempts} must be 1 to 10")
        if self.initial_backoff_seconds <= 0:
            raise ValueError(f"initial_backoff_seconds {self.initial_backoff_seconds} must be > 0")
        if self.max_backoff_seconds < self.initial_backoff_seconds:
            raise ValueError(
                f"max_backoff_seconds {self.max_backoff_seconds} must be at least "
                f"initial_backoff_seconds {self.initial_backoff_seconds}"
            )
        refuse_longer_than_the_client_waits("max_backoff_seconds", self.max_backoff_seconds)
        if self.multiplier < 1:
            raise ValueError(f"multiplier {self.multiplier} must be at least 1")
        if not 0 <= self.pushback_jitter <= 1:
            raise ValueError(f"pushback_jitter {self.pushback_jitter} must be 0 to 1")

    def delay_before_retry(self, error: ClassifyError, attempt: int) -> float | None:
        """Seconds to wait before trying again after `attempt` (1 = the first try)
        failed with `error`; None when the policy does not retry it."""
        if error.code not in self.retryable_codes or attempt >= self.max_attempts:
            return None
        if RESULT_TRACE_ID in error.metadata:
            return None  # the stored outcome of earlier work: asking again gets it again
        if error.retry_after_seconds is not None:
            hint = error.retry_after_seconds
            if not 0 <= hint <= MAX_RETRY_INFO_SECONDS:
                return None  # A6's "do not retry", or longer than the client waits
            return hint + hint * self.pushback_jitter * self.random()
        if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return None  # not an overload refusal: a limit the same call meets again
        cap = grown(
            self.initial_backoff_seconds, self.multiplier, attempt - 1, self.max_backoff_seconds
        )
        return cap * self.random()


NO_RETRIES = RetryPolicy(max_attempts=1)


@dataclass(frozen=True)
class PollPolicy:
    """How often GetResult is asked while an answer is PROCESSING."""

    # First wait after the PROCESSING answer, seconds, > 0.
    initial_interval_seconds: float = DEFAULT_POLL_INITIAL_SECONDS
    # Longest wait between two polls, seconds, >= initial_interval_seconds,
    # <= MAX_POLICY_WAIT_SECONDS.
    max_interval_seconds: float = DEFAULT_POLL_MAX_SECONDS
    # Growth per poll, >= 1.
    multiplier: float = DEFAULT_POLL_MULTIPLIER

    def __post_init__(self) -> None:
        refuse_non_finite(self)
        if self.initial_interval_seconds <= 0:
            raise ValueError(
                f"initial_interval_seconds {self.initial_interval_seconds} must be > 0"
            )
        if self.max_interval_seconds < self.initial_interval_seconds:
            raise ValueError(
                f"max_interval_seconds {self.max_interval_seconds} must be at least "
                f"initial_interval_seconds {self.initial_interval_seconds}"
            )
        refuse_longer_than_the_client_waits("max_interval_seconds", self.max_interval_seconds)
        if self.multiplier < 1:
            raise ValueError(f"multiplier {self.multiplier} must be at least 1")

    def interval(self, poll: int) -> float:
        """Seconds to wait before poll number `poll` (1 = the first GetResult)."""
        return grown(
            self.initial_interval_seconds, self.multiplier, poll - 1, self.max_interval_seconds
        )


def grown(initial: float, multiplier: float, steps: int, ceiling: float) -> float:
    """`initial` grown by `multiplier` `steps` times, at most `ceiling`. The power alone
    overflowed a float long after the ceiling was reached (the default poll schedule's
    1.5 ** n past 1,751 rounds, half an hour of polls at its 1 s), and the
    OverflowError ended the call; with `multiplier` >= 1 an overflow is past any ceiling."""
    try:
        # Floats: an int multiplier's exact power grew dearer every poll (3 ** 3e6 took
        # 0.4 s) instead of overflowing.
        return min(float(initial) * float(multiplier) ** steps, ceiling)
    except OverflowError:
        return ceiling


@dataclass(frozen=True)
class RetryEvent:
    """A failed attempt that will be tried again: what failed, and the wait before the
    next attempt. Passed to the client's `on_retry` callback."""

    method: str
    # The attempt that failed (1 = the first try).
    attempt: int
    error: ClassifyError
    delay_seconds: float


def checked_timeout(seconds: float | None) -> float | None:
    """`seconds` if it can be a call's deadline: None (no deadline), or above 0 and at
    most MAX_TIMEOUT_SECONDS. Anything else would only end every call at once with
    DEADLINE_EXCEEDED (see MAX_TIMEOUT_SECONDS)."""
    if seconds is not None and not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_SECONDS):
        raise ValueError(
            f"timeout {seconds!r} must be a number of seconds above 0 and at most "
            f"{MAX_TIMEOUT_SECONDS} (one year), or None for no deadline"
        )
    return seconds


def checked_connection_wait(seconds: float) -> float:
    """`seconds` if wait_for_connection can wait that long: above 0 and at most
    MAX_TIMEOUT_SECONDS. Unlike a call's timeout, None is refused: it waited for ever
    on a server that is down, the one thing the check is for (and NaN did the same)."""
    if seconds is None or not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_SECONDS):
        raise ValueError(
            f"wait_for_connection timeout {seconds!r} must be a number of seconds above 0 "
            f"and at most {MAX_TIMEOUT_SECONDS} (one year)"
        )
    return seconds


def is_connection_failure(error: ClassifyError) -> bool:
    """Whether `error` is gRPC's own UNAVAILABLE: no server answered the attempt (none
    could be connected to, or the connection broke), so the server sent no ErrorInfo."""
    return error.code == grpc.StatusCode.UNAVAILABLE and not error.reason


class Deadline:
    """The end of a call's time, retries and polling included; None: no deadline."""

    def __init__(self, timeout_seconds: float | None) -> None:
        checked_timeout(timeout_seconds)
        self._end = None if timeout_seconds is None else time.monotonic() + timeout_seconds

    def remaining(self) -> float | None:
        """Seconds left (never below 0), or None without a deadline."""
        return None if self._end is None else max(self._end - time.monotonic(), 0.0)

    def allows_wait(self, seconds: float) -> bool:
        """Whether a wait of `seconds` still leaves time for another call."""
        left = self.remaining()
        return left is None or seconds + MIN_SECONDS_FOR_A_CALL <= left


class Attempts:
    """The tries made of one call so far. A ClassifyBatch chunk shares one between its
    whole-call retries and its items' resends, so `max_attempts` bounds how often an
    item is sent however its tries failed (counted apart, 4 allowed 16)."""

    def __init__(self) -> None:
        self.made = 0
        self._started = time.monotonic()
        # The errors of the tries that failed as a whole, oldest first.
        self._errors: list[ClassifyError] = []

    def record_failure(self, error: ClassifyError) -> None:
        self._errors.append(error)

    def give_up(self, error: ClassifyError) -> ClassifyError:
        """`error`, the last try's (recorded last), as the call's outcome: it names how
        many tries were made and carries the earlier ones' errors, which would
        otherwise be lost (a note on each says what it was, for tracebacks and the CLI)."""
        earlier = tuple(e for e in self._errors if e is not error)
        error.attempts = self.made
        error.attempt_errors = earlier
        if self.made > 1:
            spent = time.monotonic() - self._started
            error.add_note(f"gave up after {self.made} attempts in {spent:.2f} s")
            for failed in earlier:
                error.add_note(f"an earlier attempt failed: {failed}")
        return error
