"""Every alert links to its section of docs/runbook.md, and the section is there.

Anchors are computed as GitHub renders headings: lower case, punctuation other
than '-' and '_' dropped, spaces turned into '-', and a repeated anchor suffixed
with -1, -2, ...
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tests.unit.deploy.manifests import DEPLOY_DIR

REPO_ROOT = DEPLOY_DIR.parent
RUNBOOK = "docs/runbook.md"
RULE_FILES = sorted((DEPLOY_DIR / "prometheus" / "rules").glob("*.yml"))
_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")


def heading_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading's text (before de-duplication)."""
    text = re.sub(r"`|\*\*|\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def markdown_anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown text, headings inside code fences left out."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else _HEADING.match(line)
        if match is None:
            continue
        anchor = heading_anchor(match[2])
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        anchors.add(anchor if count == 0 else f"{anchor}-{count}")
    return anchors


def alert_rules() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, rule)
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]


def missing_runbooks(rules: list[tuple[str, dict[str, Any]]], runbook_text: str) -> list[str]:
    """One line per alert without a `runbook_url` into the runbook, or whose anchor the
    runbook lacks."""
    anchors = markdown_anchors(runbook_text)
    problems = []
    for file_name, rule in rules:
        url = (rule.get("annotations") or {}).get("runbook_url")
        where = f"{file_name}: {rule['alert']}"
        if not url:
            problems.append(f"{where}: no runbook_url annotation")
            continue
        path, _, anchor = url.partition("#")
        if path != RUNBOOK or not anchor:
            problems.append(f"{where}: runbook_url {url!r} is not {RUNBOOK}#<anchor>")
        elif anchor not in anchors:
            problems.append(f"{where}: {RUNBOOK} has no heading with anchor #{anchor}")
    return problems


def test_anchors_follow_githubs_rules() -> None:
    text = "# Runbook\n## Alerts\n### `ClassifyTargetDown`\n```\n# not a heading\n```\n## Alerts\n"
    assert markdown_anchors(text) == {"runbook", "alerts", "classifytargetdown", "alerts-1"}
    assert heading_anchor("From a slow bucket: to the trace!") == "from-a-slow-bucket-to-the-trace"


def test_every_alert_has_a_runbook_url_whose_anchor_exists() -> None:
    rules = alert_rules()
    assert rules
    assert missing_runbooks(rules, (REPO_ROOT / RUNBOOK).read_text()) == []


@pytest.mark.parametrize(
    ("annotations", "problem"),
    [
        ({}, "no runbook_url annotation"),
        ({"runbook_url": f"{RUNBOOK}#gone"}, "has no heading with anchor #gone"),
        ({"runbook_url": "docs/other.md#classifytargetdown"}, "is not docs/runbook.md#<anchor>"),
    ],
)
def test_a_missing_or_dangling_runbook_url_is_named(
    annotations: dict[str, str], problem: str
) -> None:
    rule = {"alert": "ClassifyTargetDown", "annotations": annotations}
    problems = missing_runbooks([("classify.yml", rule)], "### ClassifyTargetDown\n")
    assert len(problems) == 1
    assert problems[0].startswith("classify.yml: ClassifyTargetDown: ")
    assert problems[0].endswith(problem)
