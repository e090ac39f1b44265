"""Releases: CHANGELOG.md, pyproject.toml's version and the `v*` tags agree, and
`make buf-breaking` compares the contract with the latest release by default.

The tag checks need git metadata and the tags. They skip where there are none at
all (a source tarball, or a branch-only clone without tags); a checkout that has
release tags must have one for every released version.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, run_make

CHANGELOG = REPO_ROOT / "CHANGELOG.md"
# `## [0.3.0] - 2026-12-01`; `## [Unreleased]` has no version and no date.
RELEASE_HEADING = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", re.MULTILINE)


def released_versions() -> list[str]:
    """The changelog's released versions, newest first."""
    return RELEASE_HEADING.findall(CHANGELOG.read_text())


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=30
    )


@pytest.fixture
def git_checkout() -> None:
    if git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("no git metadata: the release tags cannot be checked")
    if not git("tag", "--list", "v*").stdout.strip():
        # A clone of one branch, as some CI checkouts are, carries no tags at all;
        # a checkout with tags is held to every released version having one.
        pytest.skip("this checkout carries no release tags (a branch-only clone)")


def test_changelog_latest_release_is_the_project_version() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    versions = released_versions()

    assert versions, "CHANGELOG.md names no released version"
    assert versions[0] == project["version"]


def test_the_client_wheel_carries_the_project_version() -> None:
    """The wheel carries the contract's stubs; its version was 0.1.0 on its own, so a
    wheel did not say which release's contract it spoke."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    client_project = REPO_ROOT / "clients" / "python" / "pyproject.toml"
    client = tomllib.loads(client_project.read_text())["project"]
    assert client["version"] == project["version"]


def test_changelog_keeps_an_unreleased_section_above_the_releases() -> None:
    text = CHANGELOG.read_text()
    first_release = RELEASE_HEADING.search(text)

    assert first_release is not None
    assert "\n## [Unreleased]\n" in text[: first_release.start()]


@pytest.mark.usefixtures("git_checkout")
def test_every_released_version_has_an_annotated_tag() -> None:
    missing = [
        version
        for version in released_versions()
        if git("cat-file", "-t", f"refs/tags/v{version}").stdout.strip() != "tag"
    ]

    assert missing == [], f"no annotated tag v<version> for {missing}"


@pytest.mark.usefixtures("git_checkout")
def test_buf_breaking_compares_with_the_latest_release_tag_by_default(tmp_path: Path) -> None:
    latest = git("describe", "--tags", "--abbrev=0", "--match", "v*")
    assert latest.returncode == 0, latest.stderr

    result = run_make("buf-breaking", f"IMAGE_DIR={tmp_path}")

    assert result.returncode == 0, result.stdout + result.stderr
    assert f"buf breaking against {latest.stdout.strip()}: ok" in result.stdout
