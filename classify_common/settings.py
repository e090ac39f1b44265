"""Settings declared once: flags override environment variables override defaults.

Each layer keeps its settings in one frozen dataclass. Every field is made with
`setting()`, whose metadata (a `Spec`) holds everything else a setting needs: its
help, unit and bounds, and how a string becomes its value. The names follow from
the field's: `max_wait_ms` is `--max-wait-ms` and `<PREFIX>MAX_WAIT_MS`. From that
metadata alone `Settings.from_args` builds the parser and reads the environment,
`Settings.__post_init__` checks every bound, and `classify_common.settings_doc`
writes the documentation's tables. So a setting added in one place is a flag, an
environment variable, a bounds check and a docs row.

    Settings                   from_args(), bounds checked when built
      ServerSettings           host, ports, TLS, telemetry, grace, log level
                               (classify_common/server_settings.py)
        CapabilitySettings     (capability/config.py)
        OrchestratorSettings   (orchestrator/config.py)

Settings hold values only: files they name are read by whoever builds the
server (or by `from_args`), never while the object is constructed. Whoever reads one
first takes it through `setting_file`, which refuses anything but a regular file,
naming the flag and variable (a named pipe given as a file held the start forever).
"""

from __future__ import annotations

import argparse
import math
import os
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from decimal import Decimal
from pathlib import Path
from typing import Any, ClassVar, Self

from classify_common.documents import describe_kind

SPEC = "classify.setting"  # the field-metadata key that holds a setting's Spec


class SettingsError(ValueError):
    """A setting has a value outside its bounds; the message names flag and variable."""


def comma_list(text: str) -> tuple[str, ...]:
    """`a, b,` -> ('a', 'b'): a list setting's value from one flag or variable."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def otlp_endpoint_value(text: str) -> str:
    """`host:port` of an OTLP gRPC receiver (an IPv6 host in brackets: `[::1]:4317`).
    Without the port, gRPC dialled 443, where no collector listens: every export failed
    in the background while the server ran as if all were well."""
    value = text.strip()
    if "://" in value:
        raise ValueError(
            "give host:port without a scheme (the flag is plaintext gRPC; for TLS set "
            "OTEL_EXPORTER_OTLP_ENDPOINT=https://host:port instead)"
        )
    host, colon, port = value.rpartition(":")
    if not colon or not host:
        raise ValueError("give host:port, with the port (Jaeger's OTLP gRPC port is 4317)")
    bracketed = host.startswith("[") and host.endswith("]")
    if (":" in host and not bracketed) or host == "[]":
        raise ValueError("an IPv6 host goes in brackets, as in [::1]:4317")
    if any(character.isspace() for character in host):
        raise ValueError(f"the host {host!r} holds a space")
    # ASCII digits only: str.isdigit takes "٤٣١٧" and "²" too.
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65_535:
        raise ValueError(f"the port {port!r} is not a number from 1 to 65535")
    return value


def path_value(text: str) -> Path:
    """A file or folder setting's value. An empty one is refused: Path("") is the
    current folder, and `--routes-file ""` (or an empty variable) was read as `.`."""
    if not text.strip():
        raise ValueError("an empty path names no file")
    return Path(text)


@dataclass(frozen=True)
class Spec:
    """What one setting needs besides its name and default."""

    # One line for --help and the docs table.
    help: str
    # How the flag's or variable's text becomes the value (int, float, Path, ...).
    parse: Callable[[str], Any] = str
    # Inclusive bounds of a number; None: unbounded on that side.
    low: float | None = None
    high: float | None = None
    # A value outside the bounds that switches the feature off (0: no polling).
    off: float | None = None
    # The only values allowed, for a word.
    choices: tuple[str, ...] = ()
    # A test each value (each item of a list) must pass, and what it is called in
    # errors and the docs ("a model name").
    test: Callable[[Any], bool] | None = None
    rule: str = ""
    # Unit of a number, shown in the docs ("s", "ms").
    unit: str = ""
    # Put before the value in a bounds error ("port ").
    noun: str = ""
    # Appended to a bounds or test error in parentheses ("0 picks a free port").
    note: str = ""

    def read(self, text: str) -> Any:
        """The value a flag's or variable's text gives. A word (one of `choices`, or any
        text `parse` keeps as it is) is read without the spaces around it, as int() and
        float() read a number: `ORCHESTRATOR_PORT="50051 "` (a space left in an env file)
        was taken where `ORCHESTRATOR_AUTH="disabled "` was refused as not `disabled`.
        A path keeps its spaces: a file's name may hold them."""
        if self.choices or self.parse is str:
            text = text.strip()
        return self.parse(text)

    def check(self, value: Any, flag: str, env: str) -> None:
        """Raise SettingsError, naming flag and variable, for a value out of bounds."""
        if value is None:
            return
        if self.test is not None:
            for item in value if isinstance(value, tuple) else (value,):
                if not self.test(item):
                    note = f" ({self.note})" if self.note else ""
                    raise SettingsError(f"{flag} / {env}: {item!r} is not {self.rule}{note}")
        if self.choices and value not in self.choices:
            allowed = ", ".join(self.choices[:-1]) + f" or {self.choices[-1]}"
            raise SettingsError(f"{flag} / {env}: {value!r} is not {allowed}")
        if (self.low is None and self.high is None) or value == self.off:
            return
        if not _within(value, self.low, self.high):
            off = "" if self.off is None else f", or {spoken_number(self.off)} for off"
            note = f" ({self.note})" if self.note else ""
            raise SettingsError(
                f"{flag} / {env}: {self.noun}{_outside(value, self.low, self.high)}{off}{note}"
            )

    def bounds_text(self) -> str:
        """The bounds as the docs show them: `1..64 s`, `0 (off) or 0.1..3600`, `a or b`."""
        if self.choices:
            return " or ".join(f"`{choice}`" for choice in self.choices)
        if self.rule:
            return self.rule
        if self.low is None and self.high is None:
            return ""
        low = "" if self.low is None else spoken_number(self.low)
        high = "" if self.high is None else spoken_number(self.high)
        text = f"{low}..{high}" + (f" {self.unit}" if self.unit else "")
        return text if self.off is None else f"{spoken_number(self.off)} (off) or {text}"


def spoken_number(value: float) -> str:
    """A number as a person writes it: 1000000 rather than :g's 1e+06, 0.00001 rather
    than 1e-05, 0.05 as it is (inf and nan as Python spells them)."""
    if isinstance(value, int) or value.is_integer():
        return str(int(value))
    if not math.isfinite(value):
        return str(value)
    shortest = repr(float(value))  # the shortest text that reads back as this value
    return format(Decimal(shortest), "f") if "e" in shortest else shortest


def _within(value: float, low: float | None, high: float | None) -> bool:
    # NOTE: NaN compares false with everything, so it is never within.
    return (low is None or value >= low) and (high is None or value <= high)


def _outside(value: float, low: float | None, high: float | None) -> str:
    """`70000 is outside 0..65535`, or against one bound, `0 is below 1`."""
    shown = spoken_number(value)
    if low is not None and high is not None:
        return f"{shown} is outside {spoken_number(low)}..{spoken_number(high)}"
    if low is not None:
        return f"{shown} is below {spoken_number(low)}"
    assert high is not None  # a value with neither bound is never outside them
    return f"{shown} is above {spoken_number(high)}"


def setting(default: Any, help: str, parse: Callable[[str], Any] = str, **bounds: Any) -> Any:
    """A dataclass field that is also a flag, an environment variable and a docs row.

    `bounds` are Spec's other fields (low, high, off, choices, test, rule, unit, noun,
    note)."""
    spec = Spec(help, parse, **bounds)
    return field(default=default, metadata={SPEC: spec})


@dataclass(frozen=True)
class Declared:
    """One declared setting of a Settings class, with the names its layer gives it."""

    name: str
    flag: str
    env: str
    default: Any
    spec: Spec


@dataclass(frozen=True)
class Settings:
    """Base of a layer's settings: built from flags and environment, checked when built."""

    # Variables are named <ENV_PREFIX><FIELD NAME>, e.g. CAPABILITY_PORT.
    ENV_PREFIX: ClassVar[str] = ""
    # `python -m ...` and a one-line description, for --help.
    PROG: ClassVar[str] = ""
    DESCRIPTION: ClassVar[str] = ""

    @classmethod
    def declared(cls) -> Iterator[Declared]:
        """Every setting of this class in declaration order (inherited ones first)."""
        for item in fields(cls):
            spec = item.metadata.get(SPEC)
            if spec is not None:
                flag = "--" + item.name.replace("_", "-")
                env = cls.ENV_PREFIX + item.name.upper()
                yield Declared(item.name, flag, env, item.default, spec)

    @classmethod
    def names(cls, name: str) -> str:
        """`--flag / VARIABLE` of the setting `name`: how a refusal of it begins."""
        each = next(each for each in cls.declared() if each.name == name)
        return f"{each.flag} / {each.env}"

    @classmethod
    def names_of(cls, *names: str) -> str:
        """`names` of each of several settings refused together (a certificate and its
        key), comma-separated: set by variable, the flags alone named nothing the
        operator had written."""
        return ", ".join(cls.names(name) for name in names)

    def __post_init__(self) -> None:
        for each in self.declared():
            each.spec.check(getattr(self, each.name), each.flag, each.env)
        self.check_together()

    def check_together(self) -> None:
        """Checks that involve more than one setting; subclasses extend this."""

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ
    ) -> Self:
        """Settings from flags, else environment variables, else the declared defaults."""
        # NOTE: allow_abbrev off: argparse took `--max-wait 5` as --max-wait-ms, and a
        # flag cut short (or one a later release adds beside it) quietly set another.
        parser = argparse.ArgumentParser(
            prog=cls.PROG, description=cls.DESCRIPTION, allow_abbrev=False
        )
        for each in cls.declared():
            parser.add_argument(
                each.flag,
                dest=each.name,
                type=_flag_parser(each),
                # Left out of the result unless the flag is given: the variable is read
                # only for a setting no flag gave, so a flag wins even over a variable
                # that cannot be parsed (which stopped the start, though unused).
                default=argparse.SUPPRESS,
                # argparse formats help with %: a literal one (say "80%") must be doubled.
                help=f"{each.spec.help} [env {each.env}; default {each.default}]".replace(
                    "%", "%%"
                ),
            )
        given = vars(parser.parse_args(argv))
        return cls(
            **{
                each.name: given[each.name]
                if each.name in given
                else _from_environment(each, environ)
                for each in cls.declared()
            }
        )


def _flag_parser(each: Declared) -> Callable[[str], Any]:
    """The flag's parser for argparse: its refusal in its own words, naming the
    variable too (argparse said "invalid parse_byte_size value", the function's name,
    and dropped the parser's message)."""

    def parse(text: str) -> Any:
        try:
            return each.spec.read(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not valid: {exc} (also settable as {each.env})"
            ) from exc

    return parse


def _from_environment(each: Declared, environ: Mapping[str, str]) -> Any:
    # NOTE: `in`, not .get(): tests/deploy records which variables were asked for.
    if each.env not in environ:
        return each.default
    text = environ[each.env]
    if not text.strip():
        # An empty variable is an unset one, as OpenTelemetry's variables are read: a
        # compose file or a chart that passes `${MODEL_CONFIG:-}` through sets it
        # empty when the operator set nothing, and an empty file setting was refused.
        # An empty flag is still refused: it was typed.
        return each.default
    try:
        return each.spec.read(text)
    except ValueError as exc:
        raise SettingsError(f"{each.flag} / {each.env}: {text!r} is not valid: {exc}") from exc


def setting_file(settings: Settings, name: str) -> Path | None:
    """The file the setting `name` names, or None when it names none, once it is known
    to be a regular file (or a link to one): anything else is a SettingsError naming
    the flag and variable (see file_problem)."""
    path: Path | None = getattr(settings, name)
    if path is not None and (problem := file_problem(path)):
        raise SettingsError(f"{settings.names(name)}: {problem}")
    return path


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be read as a settings file, or None when it is a regular file
    (or a link to one). A named pipe or a device is refused before it is opened: its
    opening waited for a writer, and held the start forever."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    if stat.S_ISREG(mode):
        return None
    return f"{path} is {describe_kind(mode)}, not a regular file"


def read_secret(settings: Settings, name: str) -> str | None:
    """The token in the file the setting `name` names (surrounding whitespace dropped),
    or None when it names none; a file it cannot use is a SettingsError naming the
    flag and variable, as a bad value is."""
    path = setting_file(settings, name)
    if path is None:
        return None
    try:
        secret: str = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeError) as exc:
        problem = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SettingsError(f"{settings.names(name)}: cannot read {path}: {problem}") from exc
    if not secret:
        raise SettingsError(f"{settings.names(name)}: {path} is empty")
    return secret


def read_token(settings: Settings, name: str) -> str | None:
    """`read_secret`, for a token sent as a gRPC header value (x-internal-token): one
    that holds anything but printable ASCII without spaces (0x21-0x7E), a line break or a
    tab inside, is refused at start. gRPC refuses it in every call's metadata, and every
    request failed INTERNAL while the servers reported SERVING. (A Redis password is sent
    in the Redis protocol, which carries any byte: read_secret alone reads it.)"""
    token = read_secret(settings, name)
    if token is not None and (bad := _first_unsendable(token)) is not None:
        raise SettingsError(
            f"{settings.names(name)}: the token holds {bad!r}: a gRPC header value carries "
            "only printable ASCII characters, without spaces"
        )
    return token


def _first_unsendable(token: str) -> str | None:
    return next((char for char in token if not "!" <= char <= "~"), None)


def check_range(value: float, low: float, high: float, flag: str, env: str) -> None:
    """For bounds that depend on another setting; declared bounds go in `setting()`."""
    if not _within(value, low, high):
        raise SettingsError(f"{flag} / {env}: {_outside(value, low, high)}")
