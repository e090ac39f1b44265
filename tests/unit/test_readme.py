"""The README stays a true front page.

Every shell command it shows is run: `make test` is the suite's own command,
and tests/system/test_make_run.py starts what `make run` starts and runs the
README's call against it. Every link between the README and docs/ resolves, anchors
included.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

README = REPO_ROOT / "README.md"
MAKEFILE = REPO_ROOT / "Makefile"
# A front page, not the manual: docs/ holds the rest. 14 KB since the benchmark section
# carries what issues 11 and 12 asked of it (the figures, and what each change bought).
FRONT_PAGE_MAX_BYTES = 14 * 1024
SHELL_FENCES = {"sh", "bash", "shell"}
# What the README's Python commands start with; the test runs them with its own interpreter.
VENV_PYTHON = ".venv/bin/python"


def fenced_blocks(text: str) -> Iterator[tuple[str, str]]:
    """(info string, body) of each fenced code block."""
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        yield match.group(1), match.group(2)


def shell_commands(text: str) -> list[list[str]]:
    """Each command in the shell blocks, split as the shell would, comments dropped."""
    commands = []
    for info, body in fenced_blocks(text):
        if info not in SHELL_FENCES:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def make_prerequisites(target: str) -> list[str]:
    match = re.search(rf"^{re.escape(target)}:(.*)$", MAKEFILE.read_text(), flags=re.MULTILINE)
    assert match, f"the Makefile has no target {target!r}"
    return match.group(1).split()


def test_readme_is_a_front_page_under_14_kb_that_opens_with_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.encode()) < FRONT_PAGE_MAX_BYTES
    info, body = next(fenced_blocks(text))
    assert info == "sh"
    assert shell_commands(f"```sh\n{body}```\n") == [["make", "run"], ["make", "test"]]


def test_every_shell_command_in_the_readme_is_run_by_make_test() -> None:
    commands = shell_commands(README.read_text())
    # `make test` runs this file (through its `pytest` step); test_make_run the rest.
    assert "pytest" in make_prerequisites("test")
    assert commands[:2] == [["make", "run"], ["make", "test"]]
    assert [words[:3] for words in commands[2:]] == [[VENV_PYTHON, "-m", "classify_client"]]


def markdown_files() -> list[Path]:
    return [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a file's headings (duplicates get -1, -2, ...)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    anchors: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.name)
def test_links_from_the_readme_and_docs_resolve(path: Path) -> None:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s) and the like: not ours to check here
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists() or (anchor and anchor not in heading_anchors(linked)):
            broken.append(target)
    assert broken == []
