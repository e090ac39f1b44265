"""routes.yaml loading: the shipped file loads; every bad value is named by its path."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.routing import RoutesFileError, RouteTable, load_routes
from tests.conftest import REPO_ROOT
from tests.hostile_files import OVERSIZE_YAML_COMMENT, TOO_DEEP_YAML, nested_aliases

VALID = """\
version: 1
backends:
  topic-minilm:
    model: topic-minilm
    targets: ["127.0.0.1:50052", "10.0.0.7:50052"]
    timeout: 250ms
routes:
  - name: default
    backend: topic-minilm
"""


def load_text(tmp_path: Path, text: str) -> object:
    path = tmp_path / "routes.yaml"
    path.write_text(text)
    return load_routes(path)


def test_shipped_routes_file_loads_with_a_default_route() -> None:
    table = load_routes(REPO_ROOT / "routes.yaml")
    assert [route.name for route in table.routes] == ["static-hint", "default"]
    route = table.default_route
    assert route.name == "default"
    assert route.backend.targets == ("127.0.0.1:50052",)
    assert route.backend.timeout_seconds == 5.0
    assert [b.model for b in route.fallback] == ["topic-static"]
    assert route.retry.max_attempts == 3


def test_valid_file_parses_targets_and_millisecond_timeout(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(VALID)
    backend = load_routes(path).default_route.backend
    assert backend.targets == ("127.0.0.1:50052", "10.0.0.7:50052")
    assert backend.timeout_seconds == 0.25


def test_ipv6_targets_in_either_form_are_taken(tmp_path: Path) -> None:
    targets = '["[::1]:50052", "ipv6:[2001:db8::7]:50052,[fe80::1]:50053"]'
    text = VALID.replace('["127.0.0.1:50052", "10.0.0.7:50052"]', targets)
    backend = load_text(tmp_path, text).default_route.backend  # type: ignore[attr-defined]
    assert backend.targets == ("[::1]:50052", "ipv6:[2001:db8::7]:50052,[fe80::1]:50053")


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("backend: topic-minilm\n", "backend: bow\n", "routes[0].backend: unknown backend 'bow'"),
        ("timeout: 250ms", "timeout: 2h", "backends.topic-minilm.timeout: '2h' is not a duration"),
        (
            "timeout: 250ms",
            "timeout: 90s",
            "backends.topic-minilm.timeout: 90s is outside 1ms..60s",
        ),
        (
            "timeout: 250ms",
            "timeout: 250ms\n    colour: red",
            "backends.topic-minilm.colour: unknown key",
        ),
        (
            '"10.0.0.7:50052"',
            '"10.0.0.7"',
            "backends.topic-minilm.targets[1]: '10.0.0.7' is not host:port",
        ),
        ("version: 1", "version: 2", "version: 2 is not supported"),
        ("version: 1", "version: true", "version: True is not supported"),
        (
            '"10.0.0.7:50052"',
            '"10.0.0.7:99999"',
            "backends.topic-minilm.targets[1]: '10.0.0.7:99999' has a port outside 1..65535",
        ),
        (
            '"10.0.0.7:50052"',
            '"ipv4:10.0.0.7:50052,10.0.0.8:0"',
            "targets[1]: 'ipv4:10.0.0.7:50052,10.0.0.8:0' has a port outside 1..65535",
        ),
        # `\d` took every script's digits, and int() read them: a port in Arabic-Indic
        # digits (as a duration's number) passed.
        (
            '"10.0.0.7:50052"',
            '"localhost:\u0665\u0660\u0660\u0665\u0662"',
            "targets[1]: 'localhost:\u0665\u0660\u0660\u0665\u0662' is not host:port",
        ),
        (
            '"10.0.0.7:50052"',
            '"ipv4:10.0.0.7:\u0665\u0660\u0660\u0665\u0662"',
            "targets[1]: 'ipv4:10.0.0.7:\u0665\u0660\u0660\u0665\u0662' is not host:port",
        ),
        (
            "timeout: 250ms",
            "timeout: \u0662\u0665\u0660ms",
            "backends.topic-minilm.timeout: '\u0662\u0665\u0660ms' is not a duration",
        ),
        (
            '"10.0.0.7:50052"',
            '"999.0.0.7:50052"',
            "targets[1]: '999.0.0.7:50052': 999.0.0.7 is not an IPv4 address",
        ),
        (
            '"10.0.0.7:50052"',
            '"[:::]:50052"',
            "targets[1]: '[:::]:50052': [:::] is not an IPv6 address",
        ),
        (
            '"10.0.0.7:50052"',
            '"ipv6:[::1]:50052,[fe80::1::2]:50052"',
            "targets[1]: 'ipv6:[::1]:50052,[fe80::1::2]:50052': [fe80::1::2] is not an IPv6 "
            "address",
        ),
        (
            "  - name: default\n",
            "  - name: Default Route\n",
            "routes[0].name: 'Default Route' is not a name",
        ),
    ],
)
def test_bad_value_is_reported_with_its_path(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    assert old in VALID
    with pytest.raises(RoutesFileError) as caught:
        load_text(tmp_path, VALID.replace(old, new))
    assert message in str(caught.value)
    assert str(tmp_path / "routes.yaml") in str(caught.value)


def with_durations(top: str = "", retry: str = "") -> str:
    """VALID with `top` lines above `backends:` and the route's `retry` mapping."""
    text = VALID.replace("backends:\n", f"{top}backends:\n")
    return text + (f"    retry: {{{retry}}}\n" if retry else "")


@pytest.mark.parametrize(
    ("text", "read", "seconds"),
    [
        pytest.param(
            with_durations(top="retry_budget: {window: 120s}\n"),
            lambda table: table.retry_budget.window_seconds,
            120,
            id="window-120s",
        ),
        pytest.param(
            with_durations(top="retry_budget: {window: 2000ms}\n"),
            lambda table: table.retry_budget.window_seconds,
            2,
            id="window-2000ms",
        ),
        pytest.param(
            with_durations(top="outlier_ejection: {base_ejection: 600s, max_ejection: 3600s}\n"),
            lambda table: table.outlier_ejection.max_ejection_seconds,
            3600,
            id="max_ejection-3600s",
        ),
        pytest.param(
            with_durations(top="outlier_ejection: {max_ejection: 120s}\n"),
            lambda table: table.outlier_ejection.max_ejection_seconds,
            120,
            id="max_ejection-120s",
        ),
        pytest.param(
            with_durations(top="outlier_ejection: {base_ejection: 600s, max_ejection: 600s}\n"),
            lambda table: table.outlier_ejection.base_ejection_seconds,
            600,
            id="base_ejection-600s",
        ),
        pytest.param(
            with_durations(retry="initial_backoff: 10s, max_backoff: 60s"),
            lambda table: table.default_route.retry.initial_backoff_seconds,
            10,
            id="initial_backoff-10s",
        ),
    ],
)
def test_a_duration_field_takes_every_value_its_setting_allows(
    tmp_path: Path, text: str, read: Callable[[RouteTable], float], seconds: float
) -> None:
    """Every duration was once held to a backend timeout's 1ms..60s."""
    path = tmp_path / "routes.yaml"
    path.write_text(text)
    assert read(load_routes(path)) == seconds


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # Once accepted, and served as a 1 s window.
        pytest.param(
            with_durations(top="retry_budget: {window: 400ms}\n"),
            "2: retry_budget.window: 400ms is outside 1s..300s",
            id="window-400ms",
        ),
        # Once accepted, and served as a 2 s window.
        pytest.param(
            with_durations(top="retry_budget: {window: 1500ms}\n"),
            "2: retry_budget.window: 1500ms is not a whole number of seconds (1s..300s)",
            id="window-1500ms",
        ),
        pytest.param(
            with_durations(top="retry_budget: {window: 301s}\n"),
            "2: retry_budget.window: 301s is outside 1s..300s",
            id="window-301s",
        ),
        pytest.param(
            with_durations(top="outlier_ejection: {base_ejection: 601s}\n"),
            "2: outlier_ejection.base_ejection: 601s is outside 1ms..600s",
            id="base_ejection-601s",
        ),
        pytest.param(
            with_durations(top="outlier_ejection: {max_ejection: 3601s}\n"),
            "2: outlier_ejection.max_ejection: 3601s is outside 1ms..3600s",
            id="max_ejection-3601s",
        ),
        pytest.param(
            with_durations(retry="initial_backoff: 11s"),
            "10: routes[0].retry.initial_backoff: 11s is outside 1ms..10s",
            id="initial_backoff-11s",
        ),
        pytest.param(
            with_durations(retry="max_backoff: 61s"),
            "10: routes[0].retry.max_backoff: 61s is outside 1ms..60s",
            id="max_backoff-61s",
        ),
        pytest.param(
            VALID + "    budget: 61s\n",
            "10: routes[0].budget: 61s is outside 1ms..60s",
            id="budget-61s",
        ),
    ],
)
def test_a_duration_outside_its_field_bounds_is_refused_naming_them(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(RoutesFileError) as caught:
        load_text(tmp_path, text)
    assert str(caught.value) == f"{tmp_path / 'routes.yaml'}:{message}"


def test_duplicate_route_names_are_refused(tmp_path: Path) -> None:
    text = VALID + "  - name: default\n    backend: topic-minilm\n"
    with pytest.raises(RoutesFileError, match=r"routes\[1\]\.name: duplicate route name 'default'"):
        load_text(tmp_path, text)


def test_unreadable_and_malformed_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(RoutesFileError, match="cannot read"):
        load_routes(tmp_path / "missing.yaml")
    with pytest.raises(RoutesFileError, match="not valid YAML"):
        load_text(tmp_path, "version: [1\n")


def test_nested_aliases_are_refused_at_once_naming_file_and_line(tmp_path: Path) -> None:
    # Under an unknown key, as reported: the refusal once walked the expanded tree
    # (9 ** 8 paths here) to find the unknown key's line.
    path = tmp_path / "routes.yaml"
    path.write_text(VALID + nested_aliases(levels=8))
    started = time.perf_counter()
    with pytest.raises(RoutesFileError) as caught:
        load_routes(path)
    assert time.perf_counter() - started < 1.0
    line = VALID.count("\n") + 1
    assert str(caught.value).startswith(f"{path}:{line}: anchor &l0: YAML anchors and aliases")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (OVERSIZE_YAML_COMMENT, r"^{path}: \d+ bytes, over the 262144-byte limit"),
        (TOO_DEEP_YAML, r"^{path}:10: mappings and lists nest deeper than 32 levels"),
        ("backends: {}\n", r"^{path}:10: key 'backends' appears twice"),
    ],
)
def test_files_past_the_reading_bounds_are_refused(
    tmp_path: Path, extra: str, message: str
) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(VALID + extra)
    with pytest.raises(RoutesFileError, match=message.format(path=re.escape(str(path)))):
        load_routes(path)


def test_check_command_refuses_nested_aliases_quickly(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(VALID + nested_aliases(levels=8))
    started = time.perf_counter()
    checked = subprocess.run(
        [sys.executable, "-m", "orchestrator.routing", "check", str(path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Start-up (imports) included; expanding the aliases would take minutes.
    assert time.perf_counter() - started < 10.0
    assert checked.returncode == 1
    line = VALID.count("\n") + 1
    assert checked.stderr.startswith(f"{path}:{line}: anchor &l0: YAML anchors and aliases")


WRONGLY_TYPED_BACKEND_NAMES = [
    pytest.param(
        "    backend: [topic-minilm]\n",
        "9: routes[0].backend: expected a backend name, got list",
        id="backend-list",
    ),
    pytest.param(
        "    backend: topic-minilm\n    fallback: [{topic-minilm: 1}]\n",
        "10: routes[0].fallback[0]: expected a backend name, got dict",
        id="fallback-mapping",
    ),
    pytest.param(
        "    backend: topic-minilm\n    shadow: {backend: [topic-minilm], percent: 5}\n",
        "10: routes[0].shadow.backend: expected a backend name, got list",
        id="shadow-backend-list",
    ),
]


def refused_route(tmp_path: Path, route_lines: str) -> str:
    """The refusal of VALID with its route's backend line replaced by `route_lines`."""
    path = tmp_path / "routes.yaml"
    path.write_text(VALID.replace("    backend: topic-minilm\n", route_lines))
    with pytest.raises(RoutesFileError) as caught:
        load_routes(path)
    return str(caught.value).removeprefix(f"{path}:")


@pytest.mark.parametrize(("route_lines", "message"), WRONGLY_TYPED_BACKEND_NAMES)
def test_a_backend_name_of_the_wrong_type_is_refused_naming_file_line_and_path(
    tmp_path: Path, route_lines: str, message: str
) -> None:
    # A list or a mapping in a name's place once reached a dict lookup as a key, and
    # the TypeError escaped every caller: the check command, start-up, the watcher.
    assert refused_route(tmp_path, route_lines) == message


def test_check_command_names_a_backend_name_of_the_wrong_type(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(VALID.replace("backend: topic-minilm", "backend: [topic-minilm]"))
    checked = subprocess.run(
        [sys.executable, "-m", "orchestrator.routing", "check", str(path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (checked.returncode, checked.stderr) == (
        1,
        f"{path}:9: routes[0].backend: expected a backend name, got list\n",
    )


# Each refused at the line and path of the value at fault, where `check` said "ok" to
# the first three (a route no call could ever take, or one that hid every route after
# it) or named another line.
REFUSED_AT_THEIR_VALUE = [
    pytest.param(
        "    match: {header: {name: x-tenant-bin, values: [acme]}}\n"
        "    backend: topic-minilm\n  - name: rest\n    backend: topic-minilm\n",
        "9: routes[0].match.header.name: 'x-tenant-bin': a binary (-bin) value is never "
        "matched by a route",
        id="binary-header",
    ),
    pytest.param(
        "    match: {header: {name: x-tenant, values: [acmeé]}}\n"
        "    backend: topic-minilm\n  - name: rest\n    backend: topic-minilm\n",
        "9: routes[0].match.header.values[0]: 'acmeé': a metadata value holds only printable ASCII",
        id="header-value",
    ),
    pytest.param(
        "    match: {min_chars: 0}\n"
        "    backend: topic-minilm\n  - name: rest\n    backend: topic-minilm\n",
        "8: routes[0]: matches everything; the routes after it are never used",
        id="min-chars-zero",
    ),
    # Every text has 1..100,000 characters: these bounds hold for every call.
    pytest.param(
        "    match: {min_chars: 1}\n"
        "    backend: topic-minilm\n  - name: rest\n    backend: topic-minilm\n",
        "8: routes[0]: matches everything; the routes after it are never used",
        id="min-chars-one",
    ),
    pytest.param(
        "    match: {max_chars: 100000}\n"
        "    backend: topic-minilm\n  - name: rest\n    backend: topic-minilm\n",
        "8: routes[0]: matches everything; the routes after it are never used",
        id="max-chars-the-contracts",
    ),
    pytest.param(
        "    match: {min_chars: 100001}\n"
        "    backend: topic-minilm\n  - name: rest\n    backend: topic-minilm\n",
        "9: routes[0].match.min_chars: 100001 matches no text (a text has at most 100,000 "
        "characters)",
        id="min-chars-past-the-contracts",
    ),
    pytest.param(
        "    backend: topic-minilm\n    retry:\n      retryable_codes: [UNAVAILABLE]\n"
        "      max_attempts: 9\n",
        "12: routes[0].retry.max_attempts: max_attempts 9 is outside 1..5",
        id="retry-attempts",
    ),
    pytest.param(
        "    backend: topic-minilm\n    retry:\n      retryable_codes: [UNAVAILABLE]\n"
        "      initial_backoff: 5s\n",
        "12: routes[0].retry.initial_backoff: max_backoff must be at least initial_backoff",
        id="retry-backoffs",
    ),
    pytest.param(
        "    backend: topic-minilm\n    retry:\n      max_attempts: 2\n"
        "      retryable_codes: [INTERNAL]\n",
        "12: routes[0].retry.retryable_codes: INTERNAL may not be retried",
        id="retry-codes",
    ),
]


@pytest.mark.parametrize(("route_lines", "message"), REFUSED_AT_THEIR_VALUE)
def test_a_value_no_call_could_use_is_refused_at_its_line(
    tmp_path: Path, route_lines: str, message: str
) -> None:
    assert refused_route(tmp_path, route_lines).startswith(message)


def test_a_backend_name_yaml_reads_as_a_bool_is_refused_asking_for_quotes(
    tmp_path: Path,
) -> None:
    # Unquoted, `on` is True: the path said `backends.True` at another key's line.
    with pytest.raises(RoutesFileError) as caught:
        load_text(tmp_path, VALID.replace("  topic-minilm:\n", "  on:\n"))
    assert "backends: backend name True is not a string: quote the name" in str(caught.value)


def test_a_last_route_whose_bounds_every_text_meets_is_the_default(tmp_path: Path) -> None:
    # Refused as "must match everything", which it does: every text has 1..100,000
    # characters.
    path = tmp_path / "routes.yaml"
    path.write_text(
        VALID.replace(
            "    backend: topic-minilm\n",
            "    backend: topic-minilm\n    match: {min_chars: 1, max_chars: 100000}\n",
        )
    )
    (route,) = load_routes(path).routes
    assert route.match.is_catch_all
