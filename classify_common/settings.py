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
server (or by `from_args`), never while the object is constructed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self

SPEC = "classify.setting"  # the field-metadata key that holds a setting's Spec


class SettingsError(ValueError):
    """A setting has a value outside its bounds; the message names flag and variable."""


def comma_list(text: str) -> tuple[str, ...]:
    """`a, b,` -> ('a', 'b'): a list setting's value from one flag or variable."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


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
        low = float("-inf") if self.low is None else self.low
        high = float("inf") if self.high is None else self.high
        if not low <= value <= high:
            note = f" ({self.note})" if self.note else ""
            raise SettingsError(
                f"{flag} / {env}: {self.noun}{value} is outside {low:g}..{high:g}{note}"
            )

    def bounds_text(self) -> str:
        """The bounds as the docs show them: `1..64 s`, `0 (off) or 0.1..3600`, `a or b`."""
        if self.choices:
            return " or ".join(f"`{choice}`" for choice in self.choices)
        if self.rule:
            return self.rule
        if self.low is None and self.high is None:
            return ""
        low = "" if self.low is None else _number(self.low)
        high = "" if self.high is None else _number(self.high)
        text = f"{low}..{high}" + (f" {self.unit}" if self.unit else "")
        return text if self.off is None else f"{_number(self.off)} (off) or {text}"


def _number(value: float) -> str:
    """1000000 rather than :g's 1e+06, 0.05 as it is."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


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
        parser = argparse.ArgumentParser(prog=cls.PROG, description=cls.DESCRIPTION)
        for each in cls.declared():
            parser.add_argument(
                each.flag,
                dest=each.name,
                type=_flag_parser(each),
                default=_from_environment(each, environ),
                # argparse formats help with %: a literal one (say "80%") must be doubled.
                help=f"{each.spec.help} [env {each.env}; default {each.default}]".replace(
                    "%", "%%"
                ),
            )
        return cls(**vars(parser.parse_args(argv)))


def _flag_parser(each: Declared) -> Callable[[str], Any]:
    """The flag's parser for argparse: its refusal in its own words, naming the
    variable too (argparse said "invalid parse_byte_size value", the function's name,
    and dropped the parser's message)."""

    def parse(text: str) -> Any:
        try:
            return each.spec.parse(text)
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
    try:
        return each.spec.parse(text)
    except ValueError as exc:
        raise SettingsError(f"{each.flag} / {each.env}: {text!r} is not valid: {exc}") from exc


def read_secret(settings: Settings, name: str) -> str | None:
    """The token in the file the setting `name` names (surrounding whitespace dropped),
    or None when it names none; a file it cannot use is a SettingsError naming the
    flag and variable, as a bad value is."""
    path = getattr(settings, name)
    if path is None:
        return None
    each = next(each for each in settings.declared() if each.name == name)
    try:
        secret: str = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeError) as exc:
        problem = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SettingsError(f"{each.flag} / {each.env}: cannot read {path}: {problem}") from exc
    if not secret:
        raise SettingsError(f"{each.flag} / {each.env}: {path} is empty")
    return secret


def check_range(value: float, low: float, high: float, flag: str, env: str) -> None:
    """For bounds that depend on another setting; declared bounds go in `setting()`."""
    if not low <= value <= high:
        raise SettingsError(f"{flag} / {env}: {value} is outside {low:g}..{high:g}")
