"""Load routes.yaml into validated, immutable values.

Every error names where in the file the bad value sits
(`backends.topic-minilm.timeout: ...`), unknown keys are errors, and every
backend a route names must exist, so a typo fails at load, not at the first
request that needs it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from classify_common.documents import DocumentRefused, compose_yaml, parse_yaml, read_document
from classify_common.model_names import MODEL_NAME_RULE, is_model_name
from orchestrator.policy import OutlierSettings, RetryBudgetSettings, RetryPolicy
from orchestrator.routing.match import PRIORITIES, HeaderMatch, RequestFacts, RouteMatch

SUPPORTED_VERSION = 1
MIN_TIMEOUT_SECONDS = 0.001
MAX_TIMEOUT_SECONDS = 60.0
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s)$")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]*[a-z0-9])?$")
# host:port, [ipv6]:port, dns:///name:port (a name looked up again and again, each
# address a replica: a Kubernetes headless service's pods), or a fixed list in
# gRPC's form, ipv4:a.b.c.d:port,... or ipv6:[a::b]:port,...
_IPV4_PORT = r"\d{1,3}(?:\.\d{1,3}){3}:\d{1,5}"
_IPV6_PORT = r"\[[0-9a-fA-F:]+\]:\d{1,5}"
_TARGET = re.compile(
    r"^[^\s:/]+:\d{1,5}$|^\[[0-9a-fA-F:]+\]:\d{1,5}$|^dns:///[^\s:/]+:\d{1,5}$"
    rf"|^ipv4:{_IPV4_PORT}(?:,{_IPV4_PORT})*$|^ipv6:{_IPV6_PORT}(?:,{_IPV6_PORT})*$"
)
MAX_CONCURRENCY_LIMIT = 100_000


class RoutesFileError(ValueError):
    """routes.yaml is malformed; the message starts with the path of the bad value."""

    def __init__(
        self, where: str, problem: str, *, file: str = "", line: int | None = None
    ) -> None:
        place = f"{file}:{line}" if file and line else file
        location = ": ".join(part for part in (place, where) if part)
        super().__init__(f"{location}: {problem}" if location else problem)
        self.where = where
        self.problem = problem
        self.file = file
        self.line = line


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


def _mapping(value: Any, where: str, allowed: set[str], required: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RoutesFileError(where, f"expected a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise RoutesFileError(
            f"{where}.{unknown[0]}" if where else unknown[0],
            f"unknown key (allowed: {', '.join(sorted(allowed))})",
        )
    missing = sorted(required - set(value))
    if missing:
        raise RoutesFileError(where, f"missing required key {missing[0]!r}")
    return value


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


def parse_duration(value: Any, where: str) -> float:
    """'250ms' or '2s' (or '1.5s') to seconds, within the allowed range."""
    match = _DURATION.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise RoutesFileError(where, f"{value!r} is not a duration like 500ms or 2s")
    seconds = float(match[1]) / (1000 if match[2] == "ms" else 1)
    if not MIN_TIMEOUT_SECONDS <= seconds <= MAX_TIMEOUT_SECONDS:
        raise RoutesFileError(where, f"{value} is outside 1ms..60s")
    return seconds


_RETRY_KEYS = {"max_attempts", "initial_backoff", "max_backoff", "multiplier", "retryable_codes"}


def _retry_policy(spec: Any, where: str) -> RetryPolicy:
    spec = _mapping(spec, where, _RETRY_KEYS, set())
    defaults = RetryPolicy()
    codes = spec.get("retryable_codes", sorted(c.name for c in defaults.retryable_codes))
    if not isinstance(codes, list) or not all(isinstance(c, str) for c in codes):
        raise RoutesFileError(f"{where}.retryable_codes", "expected a list of status code names")
    try:
        parsed_codes = frozenset(grpc.StatusCode[code] for code in codes)
    except KeyError as exc:
        raise RoutesFileError(f"{where}.retryable_codes", f"unknown status code {exc}") from None
    attempts = spec.get("max_attempts", defaults.max_attempts)
    multiplier = spec.get("multiplier", defaults.multiplier)
    if not isinstance(attempts, int) or isinstance(attempts, bool):
        raise RoutesFileError(f"{where}.max_attempts", f"{attempts!r} is not an integer")
    if not isinstance(multiplier, int | float) or isinstance(multiplier, bool):
        raise RoutesFileError(f"{where}.multiplier", f"{multiplier!r} is not a number")
    try:
        return RetryPolicy(
            max_attempts=attempts,
            initial_backoff_seconds=parse_duration(
                spec.get("initial_backoff", "25ms"), f"{where}.initial_backoff"
            ),
            max_backoff_seconds=parse_duration(
                spec.get("max_backoff", "250ms"), f"{where}.max_backoff"
            ),
            multiplier=float(multiplier),
            retryable_codes=parsed_codes,
        )
    except ValueError as exc:
        raise RoutesFileError(where, str(exc)) from None


def _route_match(spec: Any, where: str) -> RouteMatch:
    keys = {"model", "priority", "min_chars", "max_chars", "header", "percent"}
    spec = _mapping(spec, where, keys, set())
    if not spec:
        raise RoutesFileError(where, "an empty match matches everything; leave it out instead")
    models = spec.get("model", [])
    if isinstance(models, str):
        models = [models]
    if not isinstance(models, list):
        raise RoutesFileError(f"{where}.model", "expected a model name or a list of them")
    for index, model in enumerate(models):
        _model_name(model, f"{where}.model[{index}]")
    priority = spec.get("priority")
    if priority is not None and priority not in PRIORITIES:
        raise RoutesFileError(f"{where}.priority", f"{priority!r} is not one of {PRIORITIES}")
    bounds: dict[str, int | None] = {}
    for key in ("min_chars", "max_chars"):
        value = spec.get(key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise RoutesFileError(f"{where}.{key}", f"{value!r} is not a non-negative integer")
        bounds[key] = value
    low, high = bounds["min_chars"], bounds["max_chars"]
    if low is not None and high is not None and low > high:
        raise RoutesFileError(where, "min_chars is greater than max_chars")
    header = None
    if "header" in spec:
        header_spec = _mapping(
            spec["header"], f"{where}.header", {"name", "values"}, {"name", "values"}
        )
        header_name = header_spec["name"]
        values = header_spec["values"]
        if not isinstance(header_name, str) or not header_name:
            raise RoutesFileError(f"{where}.header.name", "expected a metadata key")
        if (
            not isinstance(values, list)
            or not values
            or not all(isinstance(v, str) for v in values)
        ):
            raise RoutesFileError(f"{where}.header.values", "expected a non-empty list of strings")
        header = HeaderMatch(name=header_name.lower(), values=frozenset(values))
    percent = spec.get("percent")
    if percent is not None and (
        not isinstance(percent, int) or isinstance(percent, bool) or not 1 <= percent <= 100
    ):
        raise RoutesFileError(f"{where}.percent", f"{percent!r} is not a whole percentage 1..100")
    return RouteMatch(
        models=frozenset(models),
        priority=priority,
        min_chars=bounds["min_chars"],
        max_chars=bounds["max_chars"],
        header=header,
        percent=percent,
    )


def _backend(name: str, spec: Any) -> Backend:
    where = f"backends.{name}"
    spec = _mapping(
        spec, where, {"model", "targets", "timeout", "max_concurrency"}, {"model", "targets"}
    )
    limit = spec.get("max_concurrency")
    if limit is not None and (
        not isinstance(limit, int)
        or isinstance(limit, bool)
        or not 1 <= limit <= MAX_CONCURRENCY_LIMIT
    ):
        raise RoutesFileError(
            f"{where}.max_concurrency", f"{limit!r} is not an integer in 1..100000"
        )
    targets = spec["targets"]
    if not isinstance(targets, list) or not targets:
        raise RoutesFileError(f"{where}.targets", "expected a non-empty list of host:port")
    for index, target in enumerate(targets):
        if not isinstance(target, str) or not _TARGET.fullmatch(target):
            raise RoutesFileError(
                f"{where}.targets[{index}]",
                f"{target!r} is not host:port, dns:///name:port or ipv4:/ipv6: addresses",
            )
    return Backend(
        name=_name(name, where),
        model=_model_name(spec["model"], f"{where}.model"),
        targets=tuple(targets),
        timeout_seconds=parse_duration(spec.get("timeout", "5s"), f"{where}.timeout"),
        max_concurrency=limit,
    )


def parse_routes(document: Any) -> RouteTable:
    top = _mapping(
        document,
        "",
        {"version", "backends", "routes", "retry_budget", "outlier_ejection"},
        {"version", "backends", "routes"},
    )
    if top["version"] != SUPPORTED_VERSION:
        raise RoutesFileError("version", f"{top['version']!r} is not supported (expected 1)")
    if not isinstance(top["backends"], dict) or not top["backends"]:
        raise RoutesFileError("backends", "expected a non-empty mapping of name to backend")
    backends = {name: _backend(name, spec) for name, spec in top["backends"].items()}
    if not isinstance(top["routes"], list) or not top["routes"]:
        raise RoutesFileError("routes", "expected a non-empty list of routes")
    routes: list[Route] = []
    seen: set[str] = set()
    for index, spec in enumerate(top["routes"]):
        where = f"routes[{index}]"
        spec = _mapping(
            spec,
            where,
            {"name", "backend", "match", "fallback", "retry", "budget"},
            {"name", "backend"},
        )
        name = _name(spec["name"], f"{where}.name")
        if name in seen:
            raise RoutesFileError(f"{where}.name", f"duplicate route name {name!r}")
        seen.add(name)
        backend = backends.get(spec["backend"])
        if backend is None:
            raise RoutesFileError(f"{where}.backend", f"unknown backend {spec['backend']!r}")
        fallback_names = spec.get("fallback", [])
        if not isinstance(fallback_names, list):
            raise RoutesFileError(f"{where}.fallback", "expected a list of backend names")
        fallback: list[Backend] = []
        for position, fallback_name in enumerate(fallback_names):
            at = f"{where}.fallback[{position}]"
            candidate = backends.get(fallback_name)
            if candidate is None:
                raise RoutesFileError(at, f"unknown backend {fallback_name!r}")
            # A backend tried twice in one call would loop back to a failure.
            if candidate in (backend, *fallback):
                raise RoutesFileError(
                    at, f"backend {fallback_name!r} is already tried earlier in this route"
                )
            fallback.append(candidate)
        retry = _retry_policy(spec["retry"], f"{where}.retry") if "retry" in spec else RetryPolicy()
        match = _route_match(spec["match"], f"{where}.match") if "match" in spec else RouteMatch()
        time_budget = (
            parse_duration(spec["budget"], f"{where}.budget") if "budget" in spec else None
        )
        routes.append(
            Route(
                name=name,
                backend=backend,
                match=match,
                fallback=tuple(fallback),
                retry=retry,
                budget_seconds=time_budget,
            )
        )
    if not routes[-1].match.is_catch_all:
        raise RoutesFileError(
            f"routes[{len(routes) - 1}].match",
            "the last route is the default and must match everything",
        )
    budget = _retry_budget(top["retry_budget"]) if "retry_budget" in top else RetryBudgetSettings()
    outliers = (
        _outlier_settings(top["outlier_ejection"])
        if "outlier_ejection" in top
        else OutlierSettings()
    )
    return RouteTable(
        backends=backends, routes=tuple(routes), retry_budget=budget, outlier_ejection=outliers
    )


def _outlier_settings(spec: Any) -> OutlierSettings:
    where = "outlier_ejection"
    keys = {"consecutive_failures", "base_ejection", "max_ejection", "max_ejected_percent"}
    spec = _mapping(spec, where, keys, set())
    for key in ("consecutive_failures", "max_ejected_percent"):
        value = spec.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise RoutesFileError(f"{where}.{key}", f"{value!r} is not an integer")
    defaults = OutlierSettings()
    try:
        return OutlierSettings(
            consecutive_failures=spec.get("consecutive_failures", defaults.consecutive_failures),
            base_ejection_seconds=parse_duration(
                spec.get("base_ejection", f"{defaults.base_ejection_seconds}s"),
                f"{where}.base_ejection",
            ),
            max_ejection_seconds=parse_duration(
                spec.get("max_ejection", f"{defaults.max_ejection_seconds}s"),
                f"{where}.max_ejection",
            ),
            max_ejected_percent=spec.get("max_ejected_percent", defaults.max_ejected_percent),
        )
    except ValueError as exc:
        raise RoutesFileError(where, str(exc)) from None


def _retry_budget(spec: Any) -> RetryBudgetSettings:
    where = "retry_budget"
    spec = _mapping(spec, where, {"ratio", "min_retries_per_second", "window"}, set())
    for key in ("ratio", "min_retries_per_second"):
        value = spec.get(key)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
            raise RoutesFileError(f"{where}.{key}", f"{value!r} is not a number")
    defaults = RetryBudgetSettings()
    window = parse_duration(spec.get("window", f"{defaults.window_seconds}s"), f"{where}.window")
    try:
        return RetryBudgetSettings(
            ratio=float(spec.get("ratio", defaults.ratio)),
            min_retries_per_second=float(
                spec.get("min_retries_per_second", defaults.min_retries_per_second)
            ),
            window_seconds=max(1, round(window)),
        )
    except ValueError as exc:
        raise RoutesFileError(where, str(exc)) from None


def _line_index(node: yaml.Node, path: str = "") -> dict[str, int]:
    """Path of every value in the document (`routes[2].fallback[0]`) to its 1-based line."""
    lines = {path: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            child = f"{path}.{key_node.value}" if path else str(key_node.value)
            lines.update(_line_index(value_node, child))
            lines[child] = key_node.start_mark.line + 1  # the key's line reads best
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines.update(_line_index(item, f"{path}[{index}]"))
    return lines


def _line_of(where: str, lines: dict[str, int]) -> int | None:
    """The line of `where`, or of its nearest enclosing value (for a missing key)."""
    while where:
        if where in lines:
            return lines[where]
        where = where[: max(where.rfind("."), where.rfind("["), 0)]
    return None


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
        line = _line_of(exc.where, _line_index(node)) if node is not None else None
        raise RoutesFileError(exc.where, exc.problem, file=str(path), line=line) from None
    rules_version = hashlib.sha256(raw).hexdigest()[:12]
    return dataclasses.replace(table, rules_version=rules_version)
