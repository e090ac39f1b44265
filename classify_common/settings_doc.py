"""Documentation tables written from the settings' declarations.

A layer's table sits in the docs between two marker comments,

    <!-- settings: capability -->
    | capability ... | env | default | bounds | what it sets |
    ...
    <!-- /settings: capability -->

and `tools/settings_doc.py` rewrites what lies between them; a test fails when
the docs and the declarations differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from classify_common.settings import Declared, Settings


class MarkersMissing(ValueError):
    """The docs lack the marker comments that bound a generated table."""


def start_marker(name: str) -> str:
    return f"<!-- settings: {name} -->"


def end_marker(name: str) -> str:
    return f"<!-- /settings: {name} -->"


def default_text(value: Any) -> str:
    """A default as the docs show it: `50052`, `0.5`, `build/models`, none, empty."""
    if value is None:
        return "none"
    if value == ():
        return "empty"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, Path):
        return f"`{value.as_posix()}`"
    return f"`{value}`"


def _row(each: Declared) -> str:
    cells = (
        f"`{each.flag}`",
        f"`{each.env}`",
        default_text(each.default),
        each.spec.bounds_text(),
        each.spec.help,
    )
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def settings_table(settings: type[Settings], title: str) -> str:
    """The Markdown table of every declared setting of `settings`, in declaration order."""
    lines = [
        f"| {title} | env | default | bounds | what it sets |",
        "|---|---|---|---|---|",
        *(_row(each) for each in settings.declared()),
    ]
    return "\n".join(lines) + "\n"


def replace_table(text: str, name: str, table: str) -> str:
    """`text` with the lines between `name`'s markers replaced by `table`."""
    start, end = start_marker(name), end_marker(name)
    if text.count(start) != 1 or text.count(end) != 1:
        raise MarkersMissing(f"expected one {start} and one {end}")
    before, rest = text.split(start, 1)
    _, after = rest.split(end, 1)
    return f"{before}{start}\n{table}{end}{after}"
