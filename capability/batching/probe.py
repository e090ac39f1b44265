"""When a replica times a forward of its own to check the service-time fit, and how
much the fit then keeps of what it learnt before.

Admission refuses a text whose deadline is shorter than the forward the fit
predicts (wait.py), and a refused text is never computed. So the fit learns
only from texts it lets through: once it predicts more than callers give, it
refuses all of them, nothing corrects it, and the replica refuses every text
with a shorter deadline for as long as it runs. Two ways there, both measured
on the 2-core machine (2026-12-07): warm-up timed while another process took
the cores (topic-minilm's fit then predicted 136 and 244 ms for one short text
that takes about 10 ms, and every call with a 150 ms deadline was refused for
the 12 s the test ran), and one stalled forward among few (a 2 s batch after
warm-up: 686 ms predicted for one short text, the same).

The probe: when a text is refused on the fit's word while the replica has
nothing queued or computing (so the refusal rests on the fit alone), the
replica times one stand-in text of that length on its device, taking its
turn as a batch would. A probe that ends in well under the predicted time
proves the fit stale; it is recorded with half the past forgotten at once,
and the next probe follows a moment later, without waiting for another text,
until one bears the fit out. A probe that bears the fit out is recorded as
any batch, and the next waits twice as long, up to a few seconds, so a
device that really is slow pays little for being checked; so does the next
after a probe that failed.
"""

from __future__ import annotations

from dataclasses import dataclass

from capability.batching.service_time import FORGETTING

# A probe taking less than this share of the predicted time proves the fit stale.
STALE_BELOW = 0.5
# What the fit keeps of its past at a probe that proved it stale: each halves the
# weight of what came before, so a fit predicting 70 times too long (686 ms against
# about 10) comes within 2x of the truth after five probes.
STALE_PAST_WEIGHT = 0.5
# The shortest and the longest gap between probes, seconds: the gap doubles at each
# probe that bears the fit out, and goes back to the shortest at one that does not.
MIN_GAP_SECONDS = 0.1
MAX_GAP_SECONDS = 5.0
# Probes found stale lead to the next at once (MIN_GAP_SECONDS on), up to this many
# in a row: a fit 70 times too long needs about seven.
MAX_STALE_PROBES_IN_A_ROW = 16

STALE = "stale"
CONFIRMED = "confirmed"
# A probe that ended without a time: its forward, or the cold start before it, failed.
PROBE_FAILED = "failed"


@dataclass(frozen=True, slots=True)
class ProbeVerdict:
    outcome: str  # STALE or CONFIRMED
    # The weight the fit keeps of its past as it records the probe.
    past_weight: float


class FitProbe:
    """One replica's probe schedule (event-loop thread only)."""

    def __init__(self) -> None:
        self._gap = MIN_GAP_SECONDS
        # Event-loop time from which the next probe may start.
        self.next_at = 0.0
        self.running = False

    def due(self, now: float) -> bool:
        """Whether a probe may start now (none running, the gap since the last past)."""
        return not self.running and now >= self.next_at

    def judge(self, predicted: float, seconds: float, now: float) -> ProbeVerdict:
        """The verdict on a probe that took `seconds` against `predicted`, ended at `now`
        (event-loop time); schedules the next."""
        if seconds < predicted * STALE_BELOW:
            self._gap = MIN_GAP_SECONDS
            verdict = ProbeVerdict(STALE, STALE_PAST_WEIGHT)
        else:
            self._gap = min(self._gap * 2, MAX_GAP_SECONDS)
            verdict = ProbeVerdict(CONFIRMED, FORGETTING)
        self.next_at = now + self._gap
        return verdict

    def failed(self, now: float) -> None:
        """A probe ended without a time (its forward or cold start failed): wait the
        longest gap, so that a failing device is not probed at every text it refuses."""
        self._gap = MAX_GAP_SECONDS
        self.next_at = now + self._gap
