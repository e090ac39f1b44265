"""Write the configuration tables in the docs from the declared settings.

    .venv/bin/python -m tools.settings_doc          # rewrite the tables in place
    .venv/bin/python -m tools.settings_doc --check  # exit 1 when they are out of date

The tables sit in docs/configuration.md (README.md where there is no such file),
between the markers classify_common/settings_doc.py describes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from capability.config import CapabilitySettings
from classify_common.settings import Settings
from classify_common.settings_doc import replace_table, settings_table
from orchestrator.config import OrchestratorSettings

ROOT = Path(__file__).resolve().parent.parent
# (marker name, settings class, first header cell)
LAYERS: tuple[tuple[str, type[Settings], str], ...] = (
    ("capability", CapabilitySettings, "capability (`python -m capability`)"),
    ("orchestrator", OrchestratorSettings, "orchestrator (`python -m orchestrator`)"),
)


def doc_path(root: Path = ROOT) -> Path:
    """The file that holds the configuration tables."""
    docs = root / "docs" / "configuration.md"
    return docs if docs.exists() else root / "README.md"


# The first line of each generated block, for whoever opens the file to edit a row.
GENERATED_NOTE = (
    "<!-- written by `python -m tools.settings_doc` from the settings' declarations; "
    "edit those, not this table -->\n"
)


def regenerate(text: str) -> str:
    """`text` with every layer's table written afresh from its declarations."""
    for name, settings, title in LAYERS:
        text = replace_table(text, name, GENERATED_NOTE + settings_table(settings, title))
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.settings_doc",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--check", action="store_true", help="only report whether they differ")
    args = parser.parse_args(argv)
    path = doc_path()
    text = path.read_text(encoding="utf-8")
    fresh = regenerate(text)
    if fresh == text:
        return 0
    if args.check:
        print(f"{path}: the settings tables are out of date; run python -m tools.settings_doc")
        return 1
    path.write_text(fresh, encoding="utf-8")
    print(f"{path}: settings tables rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
