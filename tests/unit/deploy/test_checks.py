"""Each check of `make lint-deploy` catches a planted fault (`make lint` runs it on
deploy/ itself).

Each fault test copies deploy/ to a temporary folder, plants one fault, and runs
the checker on the copy: through `make lint-deploy DEPLOY_DIR=...` once (the
path CI takes), and one check at a time for the rest, so the suite stays quick.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, run_make
from tests.unit.deploy.manifests import DEPLOY_DIR

PROMTOOL = REPO_ROOT / "build" / "tools" / "promtool"


def run_check(deploy_dir: Path, only: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "tools/deploy_check.py", "check", "--deploy-dir", str(deploy_dir)]
    return subprocess.run(
        [*command, "--promtool", str(PROMTOOL), "--only", only],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module", autouse=True)
def promtool() -> None:
    """make installs promtool for `make lint`; a lone `pytest` run needs it too."""
    result = run_make(str(PROMTOOL.relative_to(REPO_ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def deploy_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY_DIR, copy)
    return copy


def plant(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"the fault cannot be planted: {old!r} is not in {path.name}"
    path.write_text(text.replace(old, new, 1))


def keep_rule_tests(deploy_dir: Path, keep: Callable[[Path], bool]) -> None:
    """Remove the copy's alert-rule test files that `keep` refuses. promtool runs each
    (about 12 s of CPU for all of them here, and `make lint` runs them all on deploy/
    itself); a test of the check needs only those that can pass or fail it."""
    tests = sorted((deploy_dir / "prometheus" / "tests").glob("*.yml"))
    kept = [test for test in tests if keep(test)]
    assert kept, "no rule test file left for the check to run"
    for test in tests:
        if test not in kept:
            test.unlink()


def test_make_lint_deploy_fails_on_an_unpinned_base_image(deploy_copy: Path) -> None:
    plant(
        deploy_copy / "docker" / "orchestrator.Dockerfile",
        "FROM ${PYTHON_IMAGE} AS build",
        "FROM python:latest AS build",
    )
    keep_rule_tests(deploy_copy, lambda test: test.name == "classify_model_version_test.yml")

    result = run_make("lint-deploy", f"DEPLOY_DIR={deploy_copy}")

    assert result.returncode != 0
    assert "DL3007" in result.stderr  # "Using latest is prone to errors"
    assert "hadolint: FAILED" in result.stdout
    # The other checks still ran, and passed on the unchanged files; compose's ran but
    # finds its build contexts (../) missing beside the copy. (`make lint`, which `make
    # test` runs, is the same target on deploy/ itself.)
    assert "compose: " in result.stdout
    for check in ("k8s", "prometheus", "grafana", "routes", "yaml"):
        assert f"{check}: ok" in result.stdout


@pytest.mark.parametrize(
    ("check", "file", "old", "new", "reported"),
    [
        pytest.param(
            "k8s",
            "k8s/orchestrator.yaml",
            "replicas: 2",
            'replicas: "two"',
            "replicas",
            id="k8s-wrong-field-type",
        ),
        pytest.param(
            "k8s",
            "k8s/orchestrator.yaml",
            "terminationGracePeriodSeconds: 30",
            "terminationGracePeriodSecond: 30",
            "terminationGracePeriodSecond",
            id="k8s-unknown-field",
        ),
        pytest.param(
            "compose",
            "compose.yaml",
            "stop_grace_period: 25s\n    restart: unless-stopped",
            "stop_grace_perod: 25s\n    restart: unless-stopped",
            "stop_grace_perod",
            id="compose-unknown-key",
        ),
        pytest.param(
            "compose",
            "compose.yaml",
            "      prometheus:\n        condition: service_started",
            "      prometheus-typo:\n        condition: service_started",
            "no service 'prometheus-typo'",
            id="compose-missing-dependency",
        ),
        pytest.param(
            "prometheus",
            "prometheus/rules/classify.yml",
            "expr: classify:fallback_ratio:rate5m > 0.05",
            "expr: classify:fallback_ratio:rate5m > 0.5",
            "ClassifyFallbackRateSpike",
            id="alert-threshold-its-test-pins",
        ),
        pytest.param(
            "prometheus",
            "prometheus/rules/classify.yml",
            "expr: up{job=~",
            "expr: up{job=~~",
            "classify.yml",
            id="promql-syntax",
        ),
        pytest.param(
            "routes",
            "k8s/orchestrator-routes.yaml",
            "fallback: [topic-static]",
            "fallback: [topic-statik]",
            "unknown backend 'topic-statik'",
            id="configmap-routes-unknown-backend",
        ),
        pytest.param(
            "grafana",
            "grafana/provisioning/datasources/datasources.yaml",
            "uid: prometheus",
            "uid: prom",
            "datasource uid 'prometheus' is not provisioned",
            id="dashboard-datasource-not-provisioned",
        ),
        pytest.param(
            "yaml",
            "k8s/namespace.yaml",
            "  name: classify",
            "  name: classify\n  name: classify",
            "duplication of key",
            id="yaml-duplicate-key",
        ),
    ],
)
def test_check_fails_on_a_planted_fault(
    deploy_copy: Path, check: str, file: str, old: str, new: str, reported: str
) -> None:
    plant(deploy_copy / file, old, new)
    if check == "prometheus":  # the rule tests that name what is reported can fail it
        keep_rule_tests(deploy_copy, lambda test: reported in test.read_text())

    result = run_check(deploy_copy, check)

    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{check}: FAILED" in result.stdout
    assert reported in result.stdout + result.stderr
