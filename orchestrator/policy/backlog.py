"""Refuse new calls at the front door while calls reach it with their deadlines spent.

The adaptive concurrency limit (orchestrator.policy.concurrency) guards each
backend, but a call first waits to be taken in by the orchestrator itself.
grpc.aio takes in one call at a time, each one a round trip between gRPC's
poller thread and the event loop, and on busy cores those handoffs wait for a
core. When callers arrive faster than calls are taken in, they queue there,
in front of every limit, and their handlers start with the deadline already
spent. Nobody tells those callers to wait: they are answered DEADLINE_EXCEEDED
after they gave up, and call again at once. With a fixed crowd of callers the
queue is the crowd, so it never drains.

Measured with `make bench-overload`'s last phase (routes.yaml as it is: its
fallback answers what the limit refuses, so no refusal paces anyone): 1,024
callers with 300 ms deadlines arriving at a freshly started orchestrator left
it answering 10-70 calls a second in time, every other call expiring before or
as it was taken in, while its event loop ran less than a millisecond behind.

So the gate watches the time each call has left when its handler begins. While
more than `max_late_share` of a tenant's recent calls with deadlines arrived
with less than LATE_SECONDS left (less than the orchestrator keeps to answer, so
they are refused anyway), and one still arrived late in the last
RECENT_LATE_SECONDS, the front door is behind for that tenant: its calls
are refused at once, before validation and routing, with RESOURCE_EXHAUSTED
(FRONT_DOOR_BUSY) and a retry-after hint. Those with time left get the hint
while their callers still wait, and so do the late ones whose last few
milliseconds have not run out: in a deep backlog almost every call is late, and
the few milliseconds are the only way to reach its callers. The hints spread
the refused callers over the rate calls get past the door (the k-th caller
waiting out a hint comes back after about k of them), so the crowd inside
shrinks until calls arrive in time again. Not over the rate calls are taken
in: refusals are taken in far faster than anything is served, and hints
spread over them sent the crowd straight back (the fallback phase alone, five
alternated 8 s runs: 161-318 calls a second answered in time, 5,192-8,497
ending at their callers' deadlines in gRPC's queue; counting only the calls
let through, 267-531 and 327-1,480).

The share is kept per tenant because the server cannot tell a call that waited
to be taken in from one sent with a deadline of a few milliseconds. A backlog
delays every tenant's calls, so each tenant's share rises; a tenant whose own
callers send deadlines too short to serve raises only its own, and cannot get
other tenants' calls refused.

All methods run on the event loop thread.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from classify_common.errors import FrontDoorBusy
from orchestrator.policy.pacing import RetryPacer

# A call that arrives with less than this left is late: the orchestrator keeps
# about as much to answer (orchestrator.upstream.pool.DEADLINE_SAFETY_MARGIN_SECONDS).
LATE_SECONDS = 0.01
# Weight of each new call in the smoothed share of late arrivals (about the last
# 50 calls with deadlines).
SMOOTHING = 0.02
# The share also fades with time, halving every HALF_LIFE_SECONDS, so a tenant
# whose calls stopped is not refused on old news. Slowly: in a deep backlog most
# calls expire in gRPC's queue before any handler runs, and the few that arrive
# must keep the share up between them.
HALF_LIFE_SECONDS = 10.0
# The front door is behind only while late calls still arrive: one within this many
# seconds. The share is how far behind; this, whether it still is. Without it, a share
# raised by a crowd that has since left came down only by calls in time and with
# time, and the crowd's refused callers, told to wait up to MAX_HINT_SECONDS, sent
# none: after a collapse under 1,024 callers, 32 callers arriving in time were all
# refused for the seconds after (`make bench-overload`, "healthy right after": 0 OK).
RECENT_LATE_SECONDS = 1.0
# Retry-after hints: at least this, at most MAX_HINT_SECONDS, jittered by ±JITTER.
MIN_HINT_SECONDS = 0.05
MAX_HINT_SECONDS = 5.0
JITTER = 0.2


@dataclass(frozen=True)
class BacklogSettings:
    """Orchestrator flag `--max-late-arrivals` (0: never refuse for a backlog)."""

    max_late_share: float = 0.1

    def __post_init__(self) -> None:
        if not 0 <= self.max_late_share <= 1:
            raise ValueError(f"max_late_share {self.max_late_share} is outside 0..1")


class FrontDoorBacklog:
    """The smoothed share of calls arriving late, and the refusal while it is too high."""

    def __init__(
        self,
        settings: BacklogSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self._clock = clock
        # Per tenant: the smoothed share of its calls with deadlines that arrived late,
        # and when it was last updated; and when its last late call arrived.
        self._shares: dict[str, tuple[float, float]] = {}
        self._last_late: dict[str, float] = {}
        # Retry-after hints, spread over the rate calls are taken in.
        self._pacer = RetryPacer(
            clock=clock,
            rng=rng or random.Random(),
            jitter=JITTER,
            max_seconds=MAX_HINT_SECONDS,
            min_elapsed_seconds=MIN_HINT_SECONDS,
        )

    def late_share(self, tenant: str) -> float:
        """The tenant's smoothed share of late arrivals, faded to now."""
        share, updated = self._shares.get(tenant, (0.0, 0.0))
        return share * float(0.5 ** ((self._clock() - updated) / HALF_LIFE_SECONDS))

    def behind(self, tenant: str) -> bool:
        """Whether the tenant's calls are refused now: over its share of late arrivals,
        and one arrived late lately (RECENT_LATE_SECONDS)."""
        return self._behind(tenant, self.late_share(tenant), self._clock())

    def _behind(self, tenant: str, share: float, now: float) -> bool:
        limit = self.settings.max_late_share
        if limit <= 0 or share <= limit:
            return False
        return now - self._last_late.get(tenant, -math.inf) < RECENT_LATE_SECONDS

    def admit(self, tenant: str, time_left: float | None) -> None:
        """Count a call of `tenant` whose handler began with `time_left` seconds (None: no
        deadline); FrontDoorBusy while the front door is behind for the tenant."""
        # A call without a deadline was taken in with all the time it wants: in time.
        late = time_left is not None and time_left < LATE_SECONDS
        now = self._clock()
        share = self.late_share(tenant)
        share += SMOOTHING * (float(late) - share)
        self._shares[tenant] = (share, now)
        if late:
            self._last_late[tenant] = now
        if not self._behind(tenant, share, now):
            self._pacer.count()  # it gets past the door
            return
        raise FrontDoorBusy(
            f"calls are reaching the orchestrator late ({share:.0%} of recent ones with "
            f"under {LATE_SECONDS * 1000:.0f} ms left); it is behind",
            # While nothing gets past the door (in the last window, nor in this one so
            # far), the crowd must shrink before any of it comes back.
            retry_after_seconds=self._pacer.hint(
                floor=MIN_HINT_SECONDS, without_rate=MAX_HINT_SECONDS
            ),
            late_share=round(share, 2),
        )

    @property
    def worst_late_share(self) -> float:
        """The highest tenant's share (for the gauge)."""
        return max(map(self.late_share, self._shares), default=0.0)
