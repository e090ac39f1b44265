"""The client's pure policies: retry delays as A6 and the server's pushback say, the
GetResult poll schedule, batches cut at the contract's limits, and timeouts checked
when given."""

from __future__ import annotations

import math
import re

import grpc
import pytest

from classify_client import (
    AsyncClassifyClient,
    BatchItem,
    ClassifyClient,
    ClassifyError,
    PollPolicy,
    RetryPolicy,
    StillProcessing,
    pb,
)
from classify_client._shared import (
    BATCH_MAX_CHARS,
    BATCH_MAX_ITEMS,
    MAX_REFUSED_POLLS,
    ProcessingPolls,
    batch_chunks,
)
from classify_client.retry import MAX_RETRY_INFO_SECONDS, MIN_SECONDS_FOR_A_CALL, Deadline


def refused(code: grpc.StatusCode, retry_after: float | None = None) -> ClassifyError:
    return ClassifyError("refused", code=code, retry_after_seconds=retry_after)


def test_the_servers_retry_info_delay_is_a_floor_with_jitter_above_it() -> None:
    lowest = RetryPolicy(random=lambda: 0.0)
    highest = RetryPolicy(random=lambda: 0.999)
    overloaded = refused(grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after=2.0)
    assert lowest.delay_before_retry(overloaded, attempt=1) == 2.0
    assert highest.delay_before_retry(overloaded, attempt=1) == pytest.approx(2.0 * 1.1998)


def test_without_a_hint_the_backoff_cap_grows_by_the_multiplier_up_to_its_maximum() -> None:
    policy = RetryPolicy(
        max_attempts=10,
        initial_backoff_seconds=0.1,
        multiplier=2,
        max_backoff_seconds=0.5,
        random=lambda: 0.5,
    )
    unavailable = refused(grpc.StatusCode.UNAVAILABLE)
    delays = [policy.delay_before_retry(unavailable, attempt) for attempt in range(1, 6)]
    assert delays == pytest.approx([0.05, 0.1, 0.2, 0.25, 0.25])


def test_only_retryable_codes_are_retried_and_max_attempts_counts_the_first_try() -> None:
    policy = RetryPolicy(max_attempts=3)
    assert policy.delay_before_retry(refused(grpc.StatusCode.INVALID_ARGUMENT), 1) is None
    assert policy.delay_before_retry(refused(grpc.StatusCode.DEADLINE_EXCEEDED, 1.0), 1) is None
    assert policy.delay_before_retry(refused(grpc.StatusCode.UNAVAILABLE), 2) is not None
    assert policy.delay_before_retry(refused(grpc.StatusCode.UNAVAILABLE), 3) is None


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"max_attempts": 0}, "max_attempts 0"),
        ({"initial_backoff_seconds": 0}, "initial_backoff_seconds 0"),
        ({"initial_backoff_seconds": 2, "max_backoff_seconds": 1}, "max_backoff_seconds 1"),
        ({"multiplier": 0.5}, "multiplier 0.5"),
        ({"pushback_jitter": 2}, "pushback_jitter 2"),
    ],
)
def test_a_bad_retry_setting_is_refused_naming_it(settings: dict[str, float], named: str) -> None:
    with pytest.raises(ValueError, match=f"^{named} "):
        RetryPolicy(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("policy", "settings", "named"),
    [
        (RetryPolicy, {"initial_backoff_seconds": math.nan}, "initial_backoff_seconds nan"),
        (RetryPolicy, {"max_backoff_seconds": math.inf}, "max_backoff_seconds inf"),
        (RetryPolicy, {"multiplier": math.nan}, "multiplier nan"),
        (RetryPolicy, {"pushback_jitter": math.nan}, "pushback_jitter nan"),
        (PollPolicy, {"initial_interval_seconds": math.nan}, "initial_interval_seconds nan"),
        (PollPolicy, {"max_interval_seconds": math.inf}, "max_interval_seconds inf"),
        (PollPolicy, {"multiplier": math.inf}, "multiplier inf"),
    ],
)
def test_a_policy_setting_that_is_not_finite_is_refused_naming_it(
    policy: type[RetryPolicy | PollPolicy], settings: dict[str, float], named: str
) -> None:
    """NaN passed every bound check, and infinity all but one: a retry then died in
    time.sleep (ValueError for NaN, OverflowError for infinity) or never came."""
    with pytest.raises(ValueError, match=f"^{named} must be a finite number$"):
        policy(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("policy", "settings", "named"),
    [
        (PollPolicy, {"max_interval_seconds": 7200.0}, "max_interval_seconds 7200.0"),
        (
            PollPolicy,
            {"initial_interval_seconds": 1e10, "max_interval_seconds": 1e10},
            "max_interval_seconds 10000000000.0",
        ),
        (RetryPolicy, {"max_backoff_seconds": 86400}, "max_backoff_seconds 86400"),
    ],
)
def test_a_policy_wait_longer_than_the_client_waits_for_a_server_is_refused_naming_it(
    policy: type[RetryPolicy | PollPolicy], settings: dict[str, float], named: str
) -> None:
    """Any length was taken: a call without a deadline slept hours between polls, and
    past about 9.2e9 s the sync client's wait raised OverflowError."""
    with pytest.raises(ValueError, match=f"^{named} must be at most 3600 seconds "):
        policy(**settings)  # type: ignore[arg-type]
    longest = {"max_interval_seconds" if policy is PollPolicy else "max_backoff_seconds": 3600}
    assert policy(**longest)  # type: ignore[arg-type]


def test_polls_start_short_and_grow_to_the_longest_interval() -> None:
    poll = PollPolicy(initial_interval_seconds=0.1, multiplier=2, max_interval_seconds=0.5)
    assert [poll.interval(n) for n in range(1, 6)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])


def test_a_schedule_that_has_long_reached_its_ceiling_stays_there_without_overflowing() -> None:
    """The power was computed before the ceiling was applied: the default poll schedule
    raised OverflowError at its 1,752nd round (about half an hour of 1 s polls, within
    a deadline of up to a year or none), a multiplier of 10 at its 310th, and a retry
    multiplier of 1e40 at the 9th attempt."""
    assert PollPolicy().interval(1_800) == 1.0
    assert PollPolicy(multiplier=10).interval(400) == 1.0
    policy = RetryPolicy(max_attempts=10, multiplier=1e40, random=lambda: 0.5)
    assert policy.delay_before_retry(refused(grpc.StatusCode.UNAVAILABLE), attempt=9) == 2.5


def test_a_poll_interval_past_the_deadline_is_cut_short_for_one_last_poll() -> None:
    """A round whose interval would leave no time to poll gave up there: with a 1 s
    interval, up to a second of the deadline went unused, and a result ready in it was
    StillProcessing. It waits what leaves a poll its time, and polls once more."""
    processing = pb.ClassifyResponse(request_id="r-1", status=pb.RESULT_STATUS_PROCESSING)
    items = [BatchItem(response=processing)]
    polls = ProcessingPolls(items, PollPolicy(initial_interval_seconds=1, max_interval_seconds=1))
    wait = polls.wait_before_next_round(Deadline(0.3))
    assert wait is not None
    assert 0.2 < wait <= 0.3 - MIN_SECONDS_FOR_A_CALL
    assert polls.due() == [(0, "r-1")]
    # No time for another: it ends StillProcessing, with the ID to fetch it by later.
    assert polls.wait_before_next_round(Deadline(MIN_SECONDS_FOR_A_CALL / 2)) is None
    assert isinstance(items[0].error, StillProcessing)


def test_without_a_deadline_polls_refused_ten_times_in_a_row_end_the_item() -> None:
    """A refused poll leaves its item waiting for the next round; with no deadline the
    rounds went on for ever against a front door that was gone."""
    processing = pb.ClassifyResponse(request_id="r-1", status=pb.RESULT_STATUS_PROCESSING)
    items = [BatchItem(response=processing)]
    polls = ProcessingPolls(items, PollPolicy())
    gone = refused(grpc.StatusCode.UNAVAILABLE)
    for _ in range(MAX_REFUSED_POLLS):
        assert polls.wait_before_next_round(Deadline(None)) is not None
        polls.record(0, gone)
    assert polls.wait_before_next_round(Deadline(None)) is None
    assert items[0].error is gone
    assert (gone.attempts, len(gone.attempt_errors)) == (MAX_REFUSED_POLLS, MAX_REFUSED_POLLS - 1)


def test_a_poll_meeting_a_limit_it_meets_again_ends_the_item() -> None:
    """RESOURCE_EXHAUSTED without a RetryInfo (gRPC's message size) is no refusal for the
    moment, as RetryPolicy reads it: it was polled again every round."""
    processing = pb.ClassifyResponse(request_id="r-1", status=pb.RESULT_STATUS_PROCESSING)
    items = [BatchItem(response=processing)]
    polls = ProcessingPolls(items, PollPolicy())
    assert polls.wait_before_next_round(Deadline(10)) is not None
    too_large = refused(grpc.StatusCode.RESOURCE_EXHAUSTED)
    polls.record(0, too_large)
    assert items[0].error is too_large


def test_batches_are_cut_at_the_item_limit_and_at_the_character_limit() -> None:
    short = ["x"] * (BATCH_MAX_ITEMS + 1)
    assert [len(chunk) for chunk in batch_chunks(short)] == [BATCH_MAX_ITEMS, 1]
    long = ["x" * (BATCH_MAX_CHARS // 2)] * 3
    assert list(batch_chunks(long)) == [[0, 1], [2]]


@pytest.mark.parametrize("seconds", [float("inf"), float("nan"), 0.0, -5.0, 1e10, 31_536_001.0])
async def test_a_timeout_that_is_not_finite_and_above_zero_is_refused_when_given(
    seconds: float,
) -> None:
    """Async: an AsyncClassifyClient is made inside a running event loop."""
    named = re.escape(
        f"timeout {seconds!r} must be a number of seconds above 0 and at most 31536000 "
        "(one year), or None for no deadline"
    )
    with pytest.raises(ValueError, match=f"^{named}$"):
        ClassifyClient(timeout=seconds)
    with pytest.raises(ValueError, match=f"^{named}$"):
        AsyncClassifyClient(timeout=seconds)
    with ClassifyClient() as client, pytest.raises(ValueError, match=f"^{named}$"):
        client.classify("text", timeout=seconds)


def test_what_the_same_call_would_meet_again_is_not_retried() -> None:
    """gRPC's own refusal of a message over its size limit (RESOURCE_EXHAUSTED without a
    RetryInfo) was sent four times; a negative RetryInfo (A6: do not retry) raised a
    ValueError from sleep; a GetResult of a result that failed, its stored outcome, was
    asked for four times."""
    policy = RetryPolicy(random=lambda: 0.5)
    assert policy.delay_before_retry(refused(grpc.StatusCode.RESOURCE_EXHAUSTED), 1) is None
    assert policy.delay_before_retry(refused(grpc.StatusCode.RESOURCE_EXHAUSTED, -1.0), 1) is None
    stored = ClassifyError(
        "backend down",
        code=grpc.StatusCode.UNAVAILABLE,
        metadata={"result_trace_id": "0af7651916cd43dd8448eb211c80319c"},
    )
    assert policy.delay_before_retry(stored, 1) is None
    assert policy.delay_before_retry(refused(grpc.StatusCode.UNAVAILABLE), 1) is not None


def test_a_retry_info_delay_over_an_hour_is_not_waited_for_even_without_a_deadline() -> None:
    """Waited out with no deadline, 10^10 s crashed time.sleep (OverflowError), and any
    long delay held the call for as long."""
    policy = RetryPolicy(random=lambda: 0.0)
    hour = refused(grpc.StatusCode.RESOURCE_EXHAUSTED, MAX_RETRY_INFO_SECONDS)
    assert policy.delay_before_retry(hour, 1) == MAX_RETRY_INFO_SECONDS
    longer = refused(grpc.StatusCode.RESOURCE_EXHAUSTED, MAX_RETRY_INFO_SECONDS + 1)
    assert policy.delay_before_retry(longer, 1) is None
    # A poll so refused ends its item StillProcessing (the result is kept), naming it.
    processing = pb.ClassifyResponse(request_id="r-1", status=pb.RESULT_STATUS_PROCESSING)
    items = [BatchItem(response=processing)]
    polls = ProcessingPolls(items, PollPolicy())
    assert polls.wait_before_next_round(Deadline(None)) is not None
    centuries = refused(grpc.StatusCode.RESOURCE_EXHAUSTED, 1e10)
    polls.record(0, centuries)
    assert polls.wait_before_next_round(Deadline(None)) is None
    assert isinstance(items[0].error, StillProcessing)
    assert items[0].error.attempt_errors == (centuries,)


def test_a_retry_or_poll_is_made_only_with_time_for_a_call_left_after_its_wait() -> None:
    """Polls went out with 1-5 ms left: never answerable, and counted by the front door
    against the tenant as calls arriving late."""
    deadline = Deadline(1.0)
    assert deadline.allows_wait(0.5)
    assert not deadline.allows_wait(1.0 - MIN_SECONDS_FOR_A_CALL / 2)
    assert Deadline(None).allows_wait(1e9)
