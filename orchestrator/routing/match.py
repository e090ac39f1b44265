"""What a route matches on, and the facts of a request it is matched against.

Every condition a route lists must hold (they combine with AND); a route that
lists none matches everything, which is what the final default route does.
`percent` sends a stable share of traffic to a route (a canary): a request ID
always lands in the same one of 100 slots, so a retried or polled request
follows the same route. Each percent route takes slots of its own, `percent`
of them in a row after those of the percent routes before it in the file
(RouteTable assigns them), so two canaries of 10% and 20% get 10% and 20% of
the requests that meet their other conditions; were they to test the same
slots, the second would get only what the first left of its share. A route's
`shadow` share is chosen the same way from a hash of its own (`shadow_slot`),
so which requests are shadowed does not depend on which route a canary share
sent them to.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

PRIORITIES = ("interactive", "batch")


# What gRPC sends as metadata: a key of these characters, and a text value of printable
# ASCII. Routes see text values only, so a binary (-bin) key never matches one.
_METADATA_KEY = re.compile(r"[0-9a-z_.-]+")


def metadata_problem(name: str, value: str) -> str | None:
    """Why a call could not carry `name: value` for a route to match, or None."""
    if not _METADATA_KEY.fullmatch(name):
        return "a metadata key holds only letters, digits, '-', '_' and '.'"
    if name.endswith("-bin"):
        return "a binary (-bin) value is never matched by a route"
    if not all(" " <= char <= "~" for char in value):
        return "a metadata value holds only printable ASCII"
    return None


@dataclass(frozen=True)
class RequestFacts:
    """The parts of a request routes may look at."""

    text_chars: int
    model: str  # the client's model hint; "" when none
    priority: str  # "interactive" or "batch"
    request_id: str
    # Lower-case gRPC metadata keys to values (e.g. tenant headers).
    headers: Mapping[str, str]


@dataclass(frozen=True)
class HeaderMatch:
    name: str  # lower-case metadata key
    values: frozenset[str]


@dataclass(frozen=True)
class RouteMatch:
    # Model hints this route takes; empty: any hint or none.
    models: frozenset[str] = frozenset()
    # "interactive" or "batch"; None: either.
    priority: str | None = None
    # Inclusive bounds on the text length, in characters.
    min_chars: int | None = None
    max_chars: int | None = None
    header: HeaderMatch | None = None
    # Share of requests, 1..100, chosen by a hash of the request ID; None: all.
    percent: int | None = None
    # The first of the `percent` slots in a row (of 0..99) that the share takes; the
    # route table places it after the slots of the percent routes before this one.
    first_slot: int = 0

    def __post_init__(self) -> None:
        # The table refuses shares that do not fit, naming the file's line; this holds
        # a table built in code to the same rule.
        slots = self.slots
        if slots is not None and not 0 <= slots.start < slots.stop <= 100:
            raise ValueError(f"{self.percent}% from slot {self.first_slot} does not fit in 0..99")

    @property
    def is_catch_all(self) -> bool:
        """No conditions: what the last route, the default, must be."""
        return self == RouteMatch()

    @property
    def matches_every_request(self) -> bool:
        """Whether no request can pass this route by (no conditions, or all 100 slots)."""
        return self.is_catch_all or self == RouteMatch(percent=100)

    @property
    def slots(self) -> range | None:
        """The percent share's slots; None without a percent."""
        if self.percent is None:
            return None
        return range(self.first_slot, self.first_slot + self.percent)

    def conditions(self) -> list[str]:
        """Each condition in words, for `explain`."""
        words = []
        if self.models:
            words.append(f"model in {sorted(self.models)}")
        if self.priority is not None:
            words.append(f"priority {self.priority}")
        if self.min_chars is not None:
            words.append(f"text >= {self.min_chars} chars")
        if self.max_chars is not None:
            words.append(f"text <= {self.max_chars} chars")
        if self.header is not None:
            words.append(f"header {self.header.name} in {sorted(self.header.values)}")
        if self.slots is not None:
            words.append(f"{self.percent}% of request IDs, {_spoken(self.slots)}")
        return words or ["everything"]

    def failed_conditions(self, facts: RequestFacts) -> list[str]:
        """The conditions `facts` do not meet (empty: the route matches)."""
        failed = []
        if self.models and facts.model not in self.models:
            failed.append(f"model {facts.model or '(none)'!r} not in {sorted(self.models)}")
        if self.priority is not None and facts.priority != self.priority:
            failed.append(f"priority is {facts.priority}")
        if self.min_chars is not None and facts.text_chars < self.min_chars:
            failed.append(f"text has {facts.text_chars} < {self.min_chars} chars")
        if self.max_chars is not None and facts.text_chars > self.max_chars:
            failed.append(f"text has {facts.text_chars} > {self.max_chars} chars")
        if self.header is not None:
            value = facts.headers.get(self.header.name)
            if value not in self.header.values:
                failed.append(f"header {self.header.name} is {value!r}")
        if self.slots is not None:
            slot = percent_slot(facts.request_id)
            if slot not in self.slots:
                failed.append(
                    f"request ID's slot {slot} is outside the {self.percent}% share "
                    f"({_spoken(self.slots)})"
                )
        return failed


def _spoken(slots: range) -> str:
    """`slots 10..29` (both ends included), or `slot 7` for a one-slot share."""
    if len(slots) == 1:
        return f"slot {slots.start}"
    return f"slots {slots.start}..{slots.stop - 1}"


def percent_slot(request_id: str) -> int:
    """A stable slot in 0..99 for a request ID."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 100


def shadow_slot(request_id: str) -> int:
    """A stable slot in 0..99 for a request ID, independent of `percent_slot`."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, person=b"shadow").digest()
    return int.from_bytes(digest, "big") % 100
