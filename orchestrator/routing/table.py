"""Load routes.yaml into validated, immutable values.

Every error names where in the file the bad value sits
(`backends.topic-minilm.timeout: ...`), unknown keys are errors, and every
backend a route names must exist, so a typo fails at load, not at the first
request that needs it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from classify_common.documents import (
    DocumentRefused,
    compose_yaml,
    line_of_path,
    parse_yaml,
    read_document,
)
from classify_common.fields import FieldRefused, Fields, type_name
from classify_common.intake import MAX_TEXT_CHARS
from classify_common.model_names import MODEL_NAME_RULE, is_model_name
from orchestrator.policy import OutlierSettings, RetryBudgetSettings, RetryPolicy
from orchestrator.routing.match import (
    PRIORITIES,
    HeaderMatch,
    RequestFacts,
    RouteMatch,
    metadata_problem,
    shadow_slot,
)

SUPPORTED_VERSION = 1
# A backend's per-call timeout when routes.yaml gives none.
DEFAULT_TIMEOUT_SECONDS = 5.0
# The slots a request ID falls in (match.percent_slot); percent routes share them out.
PERCENT_SLOTS = 100
# NOTE: [0-9], never \d, which matches every script's digits: a port in Arabic-Indic
# digits passed, and int() read it.
_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(ms|s)$")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]*[a-z0-9])?$")
# host:port, [ipv6]:port, dns:///name:port (a name looked up again and again, each
# address a replica: a Kubernetes headless service's pods), or a fixed list in
# gRPC's form, ipv4:a.b.c.d:port,... or ipv6:[a::b]:port,...
_IPV4_PORT = r"[0-9]{1,3}(?:\.[0-9]{1,3}){3}:[0-9]{1,5}"
_IPV6_PORT = r"\[[0-9a-fA-F:]+\]:[0-9]{1,5}"
_TARGET = re.compile(
    r"^[^\s:/]+:[0-9]{1,5}$|^\[[0-9a-fA-F:]+\]:[0-9]{1,5}$|^dns:///[^\s:/]+:[0-9]{1,5}$"
    rf"|^ipv4:{_IPV4_PORT}(?:,{_IPV4_PORT})*$|^ipv6:{_IPV6_PORT}(?:,{_IPV6_PORT})*$"
)
# Every :port of a target (after a host, a bracketed IPv6 address or a list's comma),
# and every dotted quad: checked for range, which the pattern above cannot say.
_PORT = re.compile(r":([0-9]{1,5})(?:,|$)")
_DOTTED_QUAD = re.compile(r"(?:^|[:/,])([0-9]{1,3}(?:\.[0-9]{1,3}){3})(?=:)")
# Every bracketed IPv6 address: checked as one, which the pattern above cannot do
# (`[:::]` passed, and every call to it failed UNAVAILABLE).
_BRACKETED = re.compile(r"\[([^\]]*)\]")
MAX_CONCURRENCY_LIMIT = 100_000


class RoutesFileError(FieldRefused):
    """routes.yaml is malformed; the message starts with the file, line and path of the
    bad value."""


@dataclass(frozen=True)
class DurationBounds:
    """The durations one field of routes.yaml allows: those the value it sets allows, so
    a value is refused at its own line with the field's real bounds, never accepted
    here and refused (or changed) by the settings it feeds."""

    low_seconds: float
    high_seconds: float
    # Only whole seconds (a window of one-second buckets); otherwise any ms or s.
    whole_seconds: bool = False

    def __str__(self) -> str:
        return f"{_spoken_duration(self.low_seconds)}..{_spoken_duration(self.high_seconds)}"


def _spoken_duration(seconds: float) -> str:
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


# Backend.timeout_seconds: one call to a pool.
TIMEOUT_BOUNDS = DurationBounds(0.001, 60.0)
# Route.budget_seconds: what a client waits on a route, retries and fallbacks included.
ROUTE_BUDGET_BOUNDS = DurationBounds(0.001, 60.0)
# RetryPolicy.initial_backoff_seconds and max_backoff_seconds (also >= the initial).
INITIAL_BACKOFF_BOUNDS = DurationBounds(0.001, 10.0)
MAX_BACKOFF_BOUNDS = DurationBounds(0.001, 60.0)
# OutlierSettings.base_ejection_seconds and max_ejection_seconds (also >= the base).
BASE_EJECTION_BOUNDS = DurationBounds(0.001, 600.0)
MAX_EJECTION_BOUNDS = DurationBounds(0.001, 3600.0)
# RetryBudgetSettings.window_seconds: a whole number of one-second buckets.
BUDGET_WINDOW_BOUNDS = DurationBounds(1, 300, whole_seconds=True)


@dataclass(frozen=True)
class Backend:
    name: str
    model: str
    targets: tuple[str, ...]
    timeout_seconds: float
    # Calls in flight to this backend at most; more are refused at once as overload
    # (so the route's fallback takes them). None: no limit.
    max_concurrency: int | None = None


@dataclass(frozen=True)
class Shadow:
    """A second backend that a share of a route's answered calls is also sent to, after
    the caller has its answer, to compare the two (orchestrator.shadow)."""

    backend: Backend
    # Share of the route's request IDs shadowed, 1..100, chosen by a hash of the ID.
    percent: int

    def takes(self, request_id: str) -> bool:
        return shadow_slot(request_id) < self.percent


@dataclass(frozen=True)
class Route:
    name: str
    backend: Backend
    match: RouteMatch = field(default_factory=RouteMatch)
    # Tried in order when the backend before them fails with a model error or
    # overload, after its retries.
    fallback: tuple[Backend, ...] = ()
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # Longest a client waits on this route, retries and fallbacks included; when it
    # runs out the client gets PROCESSING and polls GetResult. None: no budget.
    budget_seconds: float | None = None
    # Also sent a share of the answered calls, for comparison only. None: no shadow.
    shadow: Shadow | None = None

    @property
    def backends(self) -> tuple[Backend, ...]:
        """The primary backend, then its fallbacks."""
        return (self.backend, *self.fallback)


@dataclass(frozen=True)
class RouteTable:
    backends: Mapping[str, Backend]
    routes: tuple[Route, ...]
    retry_budget: RetryBudgetSettings = field(default_factory=RetryBudgetSettings)
    outlier_ejection: OutlierSettings = field(default_factory=OutlierSettings)
    # Which edit of the routes file this is: the first 12 hex digits of its SHA-256
    # ("" when built from a document, not a file). Traces name it on `route_match`.
    rules_version: str = ""

    @property
    def default_route(self) -> Route:
        return self.routes[-1]

    def select(self, facts: RequestFacts) -> Route:
        """The first route whose match holds; the last route matches everything."""
        for route in self.routes:
            if not route.match.failed_conditions(facts):
                return route
        return self.default_route


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise RoutesFileError(
            where, f"{value!r} is not a name (lowercase letters, digits, '.', '_', '-')"
        )
    return value


def _model_name(value: Any, where: str) -> str:
    if not is_model_name(value):
        raise RoutesFileError(where, f"{value!r} is not a model name ({MODEL_NAME_RULE})")
    return str(value)


def parse_duration(value: Any, where: str, bounds: DurationBounds) -> float:
    """'250ms' or '2s' (or '1.5s') to seconds, within the field's `bounds`."""
    match = _DURATION.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise RoutesFileError(where, f"{value!r} is not a duration like 500ms or 2s")
    seconds = float(match[1]) / (1000 if match[2] == "ms" else 1)
    if not bounds.low_seconds <= seconds <= bounds.high_seconds:
        raise RoutesFileError(where, f"{value} is outside {bounds}")
    if bounds.whole_seconds and not seconds.is_integer():
        raise RoutesFileError(where, f"{value} is not a whole number of seconds ({bounds})")
    return seconds


def _duration(spec: Fields, key: str, default_seconds: float, bounds: DurationBounds) -> float:
    """A duration like 250ms or 2s within `bounds`; absent: the default, in seconds."""
    if key not in spec:
        return default_seconds
    return parse_duration(spec.raw(key), spec.path(key), bounds)


def _section(spec: Fields, key: str, allowed: tuple[str, ...]) -> Fields:
    return Fields(spec.raw(key), spec.path(key), allowed=allowed)


_RETRY_KEYS = ("max_attempts", "initial_backoff", "max_backoff", "multiplier", "retryable_codes")


def _retry_policy(spec: Fields) -> RetryPolicy:
    defaults = RetryPolicy()
    where = spec.path("retryable_codes")
    codes = spec.raw("retryable_codes", sorted(c.name for c in defaults.retryable_codes))
    if not isinstance(codes, list) or not all(isinstance(c, str) for c in codes):
        raise RoutesFileError(where, "expected a list of status code names")
    try:
        parsed_codes = frozenset(grpc.StatusCode[code] for code in codes)
    except KeyError as exc:
        raise RoutesFileError(where, f"unknown status code {exc}") from None
    attempts = spec.integer("max_attempts", defaults.max_attempts)
    multiplier = spec.number("multiplier", defaults.multiplier)
    initial = _duration(
        spec, "initial_backoff", defaults.initial_backoff_seconds, INITIAL_BACKOFF_BOUNDS
    )
    longest = _duration(spec, "max_backoff", defaults.max_backoff_seconds, MAX_BACKOFF_BOUNDS)
    try:
        return RetryPolicy(
            max_attempts=attempts,
            initial_backoff_seconds=initial,
            max_backoff_seconds=longest,
            multiplier=multiplier,
            retryable_codes=parsed_codes,
        )
    except ValueError as exc:
        raise _refused_at_its_key(spec, exc, otherwise="retryable_codes") from None


_MATCH_KEYS = ("model", "priority", "min_chars", "max_chars", "header", "percent")


def _route_match(spec: Fields) -> RouteMatch:
    if not list(spec):
        raise RoutesFileError(spec.where, "an empty match matches everything; leave it out instead")
    models = spec.raw("model", [])
    if isinstance(models, str):
        models = [models]
    if not isinstance(models, list):
        raise RoutesFileError(spec.path("model"), "expected a model name or a list of them")
    if "model" in spec and not models:
        # Read as no condition, `model: []` beside `priority: batch` took every batch
        # call, whatever model it named.
        raise RoutesFileError(
            spec.path("model"), "an empty list names no model; name one, or leave the key out"
        )
    for index, model in enumerate(models):
        _model_name(model, f"{spec.path('model')}[{index}]")
    priority = spec.raw("priority", None)
    if priority is not None and priority not in PRIORITIES:
        raise RoutesFileError(spec.path("priority"), f"{priority!r} is not one of {PRIORITIES}")
    low, high = _char_count(spec, "min_chars"), _char_count(spec, "max_chars")
    # Every text routed has 1..MAX_TEXT_CHARS characters (the contract's rules come
    # first): a bound that every text meets is no condition (see is_catch_all). Read
    # as one, `min_chars: 1` on an early route took every call unnoticed, the routes
    # after it dead, and on the last route it was refused as not the default.
    if low is not None and low <= 1:
        low = None
    if high is not None and high >= MAX_TEXT_CHARS:
        high = None
    if high == 0:
        raise RoutesFileError(
            spec.path("max_chars"), "0 matches no text (every text has a character or more)"
        )
    if low is not None and low > MAX_TEXT_CHARS:
        raise RoutesFileError(
            spec.path("min_chars"),
            f"{low} matches no text (a text has at most {MAX_TEXT_CHARS:,} characters)",
        )
    if low is not None and high is not None and low > high:
        raise RoutesFileError(spec.where, "min_chars is greater than max_chars")
    header = (
        _header_match(_section(spec, "header", ("name", "values"))) if "header" in spec else None
    )
    percent = spec.optional_integer("percent")
    if percent is not None and not 1 <= percent <= 100:
        raise RoutesFileError(spec.path("percent"), f"{percent!r} is not a whole percentage 1..100")
    return RouteMatch(
        models=frozenset(models),
        priority=priority,
        min_chars=low,
        max_chars=high,
        header=header,
        percent=percent,
    )


def _char_count(spec: Fields, key: str) -> int | None:
    count = spec.optional_integer(key)
    if count is not None and count < 0:
        raise RoutesFileError(spec.path(key), f"{count!r} is not a non-negative integer")
    return count


def _header_match(spec: Fields) -> HeaderMatch:
    name, values = spec.raw("name"), spec.raw("values")
    if not isinstance(name, str) or not name:
        raise RoutesFileError(spec.path("name"), "expected a metadata key")
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise RoutesFileError(spec.path("values"), "expected a non-empty list of strings")
    # A route no call can match would pass silently: `explain` refused such a header,
    # and the server never sees one.
    problem = metadata_problem(name.lower(), "")
    if problem is not None:
        raise RoutesFileError(spec.path("name"), f"{name!r}: {problem}")
    for index, value in enumerate(values):
        problem = metadata_problem(name.lower(), value)
        if problem is not None:
            raise RoutesFileError(f"{spec.path('values')}[{index}]", f"{value!r}: {problem}")
    return HeaderMatch(name=name.lower(), values=frozenset(values))


_BACKEND_KEYS = ("model", "targets", "timeout", "max_concurrency")


def _backend(name: str, document: Any) -> Backend:
    spec = Fields(document, f"backends.{name}", allowed=_BACKEND_KEYS)
    model, targets = spec.raw("model"), spec.raw("targets")
    limit = spec.optional_integer("max_concurrency")
    if limit is not None and not 1 <= limit <= MAX_CONCURRENCY_LIMIT:
        raise RoutesFileError(
            spec.path("max_concurrency"), f"{limit!r} is not an integer in 1..100000"
        )
    if not isinstance(targets, list) or not targets:
        raise RoutesFileError(spec.path("targets"), "expected a non-empty list of host:port")
    for index, target in enumerate(targets):
        where = f"{spec.path('targets')}[{index}]"
        if not isinstance(target, str) or not _TARGET.fullmatch(target):
            raise RoutesFileError(
                where, f"{target!r} is not host:port, dns:///name:port or ipv4:/ipv6: addresses"
            )
        if any(not 1 <= int(port) <= 65535 for port in _PORT.findall(target)):
            raise RoutesFileError(where, f"{target!r} has a port outside 1..65535")
        for quad in _DOTTED_QUAD.findall(target):
            if any(int(octet) > 255 for octet in quad.split(".")):
                raise RoutesFileError(where, f"{target!r}: {quad} is not an IPv4 address")
        for address in _BRACKETED.findall(target):
            try:
                ipaddress.IPv6Address(address)
            except ValueError:
                raise RoutesFileError(
                    where, f"{target!r}: [{address}] is not an IPv6 address"
                ) from None
    return Backend(
        name=_name(name, spec.where),
        model=_model_name(model, spec.path("model")),
        targets=tuple(targets),
        timeout_seconds=_duration(spec, "timeout", DEFAULT_TIMEOUT_SECONDS, TIMEOUT_BOUNDS),
        max_concurrency=limit,
    )


_TOP_KEYS = ("version", "backends", "routes", "retry_budget", "outlier_ejection")
_ROUTE_KEYS = ("name", "backend", "match", "fallback", "retry", "budget", "shadow")
_SHADOW_KEYS = ("backend", "percent")
_OUTLIER_KEYS = ("consecutive_failures", "base_ejection", "max_ejection", "max_ejected_percent")
_BUDGET_KEYS = ("ratio", "min_retries_per_second", "window")


def parse_routes(document: Any) -> RouteTable:
    """The route table in a parsed routes.yaml; errors name the path of the bad value."""
    try:
        return _route_table(Fields(document, allowed=_TOP_KEYS))
    except FieldRefused as exc:
        raise RoutesFileError(exc.where, exc.problem) from None


def _route_table(top: Fields) -> RouteTable:
    version = top.raw("version")
    # `true` is not a version, although Python's True == 1.
    if type(version) is not int or version != SUPPORTED_VERSION:
        raise RoutesFileError("version", f"{version!r} is not supported (expected 1)")
    backend_specs = top.raw("backends")
    if not isinstance(backend_specs, dict) or not backend_specs:
        raise RoutesFileError("backends", "expected a non-empty mapping of name to backend")
    for name in backend_specs:
        if not isinstance(name, str):
            # YAML reads a bare on/off/yes/no/null key as a bool or None: a path made of
            # it names neither the key as written nor its line.
            raise RoutesFileError(
                "backends", f"backend name {name!r} is not a string: quote the name"
            )
    backends = {name: _backend(name, spec) for name, spec in backend_specs.items()}
    route_specs = top.raw("routes")
    if not isinstance(route_specs, list) or not route_specs:
        raise RoutesFileError("routes", "expected a non-empty list of routes")
    routes: list[Route] = []
    percent_slots_taken = 0
    for index, document in enumerate(route_specs):
        route = _route(Fields(document, f"routes[{index}]", allowed=_ROUTE_KEYS), backends)
        if any(route.name == earlier.name for earlier in routes):
            raise RoutesFileError(f"routes[{index}].name", f"duplicate route name {route.name!r}")
        percent = route.match.percent
        if percent is not None:
            route = _take_percent_slots(route, percent_slots_taken, f"routes[{index}]")
            percent_slots_taken += percent
        routes.append(route)
    for index, route in enumerate(routes[:-1]):
        if route.match.matches_every_request:
            raise RoutesFileError(
                f"routes[{index}]",
                "matches everything; the routes after it are never used "
                "(give it a match, or make it the last route)",
            )
    if not routes[-1].match.is_catch_all:
        raise RoutesFileError(
            f"routes[{len(routes) - 1}].match",
            "the last route is the default and must match everything",
        )
    budget = (
        _retry_budget(_section(top, "retry_budget", _BUDGET_KEYS))
        if "retry_budget" in top
        else RetryBudgetSettings()
    )
    outliers = (
        _outlier_settings(_section(top, "outlier_ejection", _OUTLIER_KEYS))
        if "outlier_ejection" in top
        else OutlierSettings()
    )
    return RouteTable(
        backends=backends, routes=tuple(routes), retry_budget=budget, outlier_ejection=outliers
    )


def _take_percent_slots(route: Route, taken: int, where: str) -> Route:
    """`route` with its percent share placed on the slots after the `taken` ones of the
    percent routes before it, so that no two routes' shares overlap."""
    percent = route.match.percent
    assert percent is not None
    if taken + percent > PERCENT_SLOTS:
        raise RoutesFileError(
            f"{where}.match.percent",
            f"{percent}% does not fit: each percent route takes slots of its own, after "
            f"those of the percent routes before it, and they have taken {taken} of the "
            f"{PERCENT_SLOTS}, leaving {PERCENT_SLOTS - taken}",
        )
    match = dataclasses.replace(route.match, first_slot=taken)
    return dataclasses.replace(route, match=match)


def _backend_named(value: Any, where: str, backends: Mapping[str, Backend]) -> Backend:
    """The backend a route names at `where`.

    NOTE: the type is checked before the lookup: a list or a mapping in a name's place
    (`backend: [topic-static]`) is unhashable, and the lookup would raise TypeError,
    which no caller reports as a bad file."""
    if not isinstance(value, str):
        raise RoutesFileError(where, f"expected a backend name, got {type_name(value)}")
    backend = backends.get(value)
    if backend is None:
        raise RoutesFileError(where, f"unknown backend {value!r}")
    return backend


def _route(spec: Fields, backends: Mapping[str, Backend]) -> Route:
    name = _name(spec.raw("name"), spec.path("name"))
    backend = _backend_named(spec.raw("backend"), spec.path("backend"), backends)
    fallback_names = spec.raw("fallback", [])
    if not isinstance(fallback_names, list):
        raise RoutesFileError(spec.path("fallback"), "expected a list of backend names")
    fallback: list[Backend] = []
    for position, fallback_name in enumerate(fallback_names):
        at = f"{spec.path('fallback')}[{position}]"
        candidate = _backend_named(fallback_name, at, backends)
        # A backend tried twice in one call would loop back to a failure.
        if candidate in (backend, *fallback):
            raise RoutesFileError(
                at, f"backend {fallback_name!r} is already tried earlier in this route"
            )
        fallback.append(candidate)
    retry = _retry_policy(_section(spec, "retry", _RETRY_KEYS)) if "retry" in spec else None
    match = _route_match(_section(spec, "match", _MATCH_KEYS)) if "match" in spec else None
    budget = (
        parse_duration(spec.raw("budget"), spec.path("budget"), ROUTE_BUDGET_BOUNDS)
        if "budget" in spec
        else None
    )
    shadow = (
        _shadow(_section(spec, "shadow", _SHADOW_KEYS), backends, backend)
        if "shadow" in spec
        else None
    )
    return Route(
        name=name,
        backend=backend,
        match=match or RouteMatch(),
        fallback=tuple(fallback),
        retry=retry or RetryPolicy(),
        budget_seconds=budget,
        shadow=shadow,
    )


def _shadow(spec: Fields, backends: Mapping[str, Backend], primary: Backend) -> Shadow:
    backend = _backend_named(spec.raw("backend"), spec.path("backend"), backends)
    if backend is primary:
        raise RoutesFileError(
            spec.path("backend"),
            f"backend {backend.name!r} is the route's own backend; nothing to compare",
        )
    return Shadow(backend=backend, percent=spec.integer("percent", low=1, high=100))


def _outlier_settings(spec: Fields) -> OutlierSettings:
    defaults = OutlierSettings()
    failures = spec.integer("consecutive_failures", defaults.consecutive_failures)
    percent = spec.integer("max_ejected_percent", defaults.max_ejected_percent)
    base = _duration(spec, "base_ejection", defaults.base_ejection_seconds, BASE_EJECTION_BOUNDS)
    longest = _duration(spec, "max_ejection", defaults.max_ejection_seconds, MAX_EJECTION_BOUNDS)
    try:
        return OutlierSettings(
            consecutive_failures=failures,
            base_ejection_seconds=base,
            max_ejection_seconds=longest,
            max_ejected_percent=percent,
        )
    except ValueError as exc:
        raise _refused_at_its_key(spec, exc) from None


def _retry_budget(spec: Fields) -> RetryBudgetSettings:
    defaults = RetryBudgetSettings()
    ratio = spec.number("ratio", defaults.ratio)
    floor = spec.number("min_retries_per_second", defaults.min_retries_per_second)
    window = _duration(spec, "window", defaults.window_seconds, BUDGET_WINDOW_BOUNDS)
    try:
        return RetryBudgetSettings(
            ratio=ratio, min_retries_per_second=floor, window_seconds=int(window)
        )
    except ValueError as exc:
        raise _refused_at_its_key(spec, exc) from None


def _refused_at_its_key(
    spec: Fields, refusal: ValueError, otherwise: str | None = None
) -> RoutesFileError:
    """A settings class's refusal of a section's values, at the line of the bad value,
    not of the section's name: the key its message starts with ("<key> <value> is
    outside ..."), else another key of the file's that it names ("max_backoff must be
    at least initial_backoff", where only initial_backoff was written), else
    `otherwise` (a message naming no key), else the section."""
    message = str(refusal)
    words = set(re.findall(r"\w+", message))
    written = list(spec)
    named = [message.split(" ", 1)[0], *(key for key in written if key in words)]
    for key in (*named, otherwise):
        if key is not None and key in spec:
            return RoutesFileError(spec.path(key), message)
    return RoutesFileError(spec.where, message)


def load_routes(path: Path) -> RouteTable:
    """The route table in `path`, read within classify_common.documents' bounds (size,
    depth, no YAML aliases), so any file costs at most one bounded parse to refuse.
    Blocking: a server calls it on a worker thread."""
    try:
        raw = read_document(path)
        document = parse_yaml(raw, str(path))
    except OSError as exc:
        raise RoutesFileError("", f"cannot read: {exc.strerror}", file=str(path)) from exc
    except DocumentRefused as exc:
        raise RoutesFileError("", exc.problem, file=str(path), line=exc.line) from exc
    try:
        table = parse_routes(document)
    except RoutesFileError as exc:
        # The same bounded parse again, keeping lines: the text has passed it once, and
        # without aliases its tree has no more nodes than the file has values.
        node = compose_yaml(raw, str(path))
        line = line_of_path(node, exc.where) if node is not None else None
        raise RoutesFileError(exc.where, exc.problem, file=str(path), line=line) from None
    rules_version = hashlib.sha256(raw).hexdigest()[:12]
    return dataclasses.replace(table, rules_version=rules_version)
