"""One reader for the mappings of every YAML document the servers read.

A `Fields` wraps one mapping of a parsed document and hands out its values key by
key, each checked for its type and bounds: an integer is never a bool, a number
is an int or a float, a word is one of its choices. A key that is absent gets the
default the caller passes (a named constant); without one it is required. Keys
nobody asked for are refused by `refuse_unknown()`. Every refusal is a
`FieldRefused` that carries the path of the value (`tenants.acme.burst`);
`read_yaml` adds the file and the line, so each document's loader only translates
it into its own error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any, Final, TypeVar

from classify_common.documents import compose_yaml, line_of_path, parse_yaml, read_document
from classify_common.settings import spoken_number

T = TypeVar("T")


class FieldRefused(ValueError):
    """A value in a document is missing, of the wrong type or out of bounds."""

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


def read_yaml(path: Path, read: Callable[[Any], T]) -> T:
    """`read` applied to the YAML document in `path`, within classify_common.documents'
    bounds; a FieldRefused it raises comes back naming the file and the line of the
    bad value. OSError and DocumentRefused are the caller's to report."""
    raw = read_document(path)
    document = parse_yaml(raw, str(path))
    try:
        return read(document)
    except FieldRefused as exc:
        # The same bounded parse again, keeping lines: the text has passed it once.
        node = compose_yaml(raw, str(path))
        line = line_of_path(node, exc.where) if node is not None else None
        raise FieldRefused(exc.where, exc.problem, file=str(path), line=line) from None


def _yaml_hint(value: object, *, whole: bool = False) -> str:
    """What to write instead of a number in exponent form that YAML read as a string, as
    `: ...` to follow a refusal; "" for anything else. PyYAML reads YAML 1.1, where a
    float with an exponent needs a dot and a signed exponent: `1.5e1` and `1e3` are
    strings, and "'1e3' is not a number" read as nonsense. `whole`: an integer is
    wanted, which no exponent form gives (YAML reads 1.0e+3 as a float)."""
    if not isinstance(value, str) or not {"e", "E"} & set(value):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number):
        return ""
    why = (
        ": YAML reads it as a string (YAML 1.1 takes an exponent only after a dot and with a sign)"
    )
    if whole:
        return f"{why}, so write {int(number)}" if number.is_integer() else why
    mantissa, _, exponent = value.strip().lower().partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    if not exponent.startswith(("+", "-")):
        exponent = "+" + exponent
    return f"{why}, so write {spoken_number(number)} or {mantissa}e{exponent}"


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


# The default of a key that must be present.
REQUIRED: Final = _Required()


def type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


class Fields:
    """The values of one mapping, read key by key; errors name the path of the value."""

    def __init__(
        self, document: object, where: str = "", *, allowed: Collection[str] | None = None
    ) -> None:
        """`allowed`: refuse any other key at once, before any value is read."""
        if not isinstance(document, dict):
            raise FieldRefused(where, f"expected a mapping, got {type_name(document)}")
        self._values: dict[Any, Any] = document
        self._where = where
        self._asked: set[str] = set()
        if allowed is not None:
            self._asked.update(allowed)
            self.refuse_unknown()

    @property
    def where(self) -> str:
        """The path of this mapping in its document ("" for the top)."""
        return self._where

    def path(self, key: object) -> str:
        return f"{self._where}.{key}" if self._where else str(key)

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        """The keys, as strings, in document order."""
        return (str(key) for key in self._values)

    def raw_keys(self) -> list[Any]:
        """The keys as parsed, in document order: YAML reads `123:` as an int and `on:`
        as a bool, which a reader of names refuses rather than looks up as strings."""
        return list(self._values)

    def raw(self, key: str, default: Any = REQUIRED) -> Any:
        """The value as parsed, unchecked (for values with their own parser)."""
        self._asked.add(key)
        if key in self._values:
            return self._values[key]
        if default is REQUIRED:
            raise FieldRefused(self._where, f"missing required key {key!r}")
        return default

    def integer(
        self, key: str, default: Any = REQUIRED, *, low: int | None = None, high: int | None = None
    ) -> int:
        value = self.raw(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise FieldRefused(
                self.path(key), f"{value!r} is not an integer{_yaml_hint(value, whole=True)}"
            )
        return int(self._within(key, value, low, high))

    def number(
        self,
        key: str,
        default: Any = REQUIRED,
        *,
        low: float | None = None,
        high: float | None = None,
    ) -> float:
        """An int or a float, as a float: finite (NaN passed every bound, since it
        compares false with everything) and within `low`..`high`."""
        value = self.raw(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise FieldRefused(self.path(key), f"{value!r} is not a number{_yaml_hint(value)}")
        try:
            number = float(value)
        except OverflowError:
            # A YAML int past a float's range (400 digits): float() raised OverflowError,
            # a traceback at start and a failed reload, with no file or line named.
            raise FieldRefused(
                self.path(key), f"a whole number of {len(str(abs(value)))} digits is too large"
            ) from None
        if not math.isfinite(number):
            raise FieldRefused(self.path(key), f"{spoken_number(number)} is not a finite number")
        return self._within(key, number, low, high)

    def optional_integer(self, key: str) -> int | None:
        """An integer, or None when the key is absent or null."""
        return None if self.raw(key, None) is None else self.integer(key)

    def optional_number(self, key: str) -> float | None:
        """A number, or None when the key is absent or null."""
        return None if self.raw(key, None) is None else self.number(key)

    def string(self, key: str, default: Any = REQUIRED) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str):
            raise FieldRefused(self.path(key), f"{value!r} is not a string")
        return value

    def choice(self, key: str, choices: tuple[str, ...], default: Any = REQUIRED) -> str:
        value = self.raw(key, default)
        if value not in choices:
            raise FieldRefused(self.path(key), f"{value!r} is not one of {choices}")
        return str(value)

    def integers(self, key: str, default: Any = REQUIRED) -> tuple[int, ...]:
        values = self.raw(key, default)
        if not isinstance(values, list | tuple) or not all(
            isinstance(value, int) and not isinstance(value, bool) for value in values
        ):
            raise FieldRefused(self.path(key), f"{values!r} is not a list of integers")
        return tuple(values)

    def items(self, key: str) -> list[Any]:
        """A list (absent or null: empty), its items unchecked."""
        values = self.raw(key, None)
        if values is None:
            return []
        if not isinstance(values, list):
            raise FieldRefused(self.path(key), f"expected a list, got {type_name(values)}")
        return values

    def mapping(self, key: str) -> Fields:
        """A nested mapping (absent or null: empty)."""
        value = self.raw(key, None)
        return Fields({} if value is None else value, self.path(key))

    def refuse_unknown(self) -> None:
        """Refuse a key no reader asked for."""
        unknown = sorted(str(key) for key in self._values if key not in self._asked)
        if unknown:
            allowed = ", ".join(sorted(self._asked))
            raise FieldRefused(self.path(unknown[0]), f"unknown key (allowed: {allowed})")

    def _within(self, key: str, value: float, low: float | None, high: float | None) -> float:
        if (low is not None and value < low) or (high is not None and value > high):
            span = (
                f"{'' if low is None else spoken_number(low)}.."
                f"{'' if high is None else spoken_number(high)}"
            )
            raise FieldRefused(self.path(key), f"{spoken_number(value)} is outside {span}")
        return value
