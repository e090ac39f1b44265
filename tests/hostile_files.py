"""Config-file content built to cost its reader dearly: each server's reader must refuse
it at once, naming the file (and the line, where there is one)."""

from __future__ import annotations

import itertools

from classify_common.documents import MAX_DOCUMENT_BYTES, MAX_DOCUMENT_DEPTH


def nested_aliases(levels: int = 8) -> str:
    """YAML mapping entries where each list holds nine aliases of the one before: under
    500 bytes that stand for 9 ** levels strings once expanded (levels=7 froze the
    orchestrator for 8 s while it looked up a line number; each level costs 9x more)."""
    names = [f"l{level}" for level in range(levels)]
    lines = [f"{names[0]}: &{names[0]} [x, x, x, x, x, x, x, x, x]"]
    lines += [
        f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]"
        for previous, name in itertools.pairwise(names)
    ]
    return "\n".join(lines) + "\n"


# One list nested a level past the cap, as a YAML mapping entry and as a JSON value.
TOO_DEEP_YAML = "deep: " + "[" * (MAX_DOCUMENT_DEPTH + 1) + "]" * (MAX_DOCUMENT_DEPTH + 1) + "\n"
TOO_DEEP_JSON = "[" * (MAX_DOCUMENT_DEPTH + 1) + "]" * (MAX_DOCUMENT_DEPTH + 1)

# A YAML comment that takes a file past the size cap on its own.
OVERSIZE_YAML_COMMENT = "#" + "x" * MAX_DOCUMENT_BYTES + "\n"
