"""Load the deploy files as the engines would read them, for the wiring tests."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO_ROOT

DEPLOY_DIR = REPO_ROOT / "deploy"
COMPOSE_FILE = DEPLOY_DIR / "compose.yaml"
K8S_DIR = DEPLOY_DIR / "k8s"
DOCKER_DIR = DEPLOY_DIR / "docker"
# ${NAME:-default} as compose interpolates it when NAME is unset.
_INTERPOLATION = re.compile(r"\$\{[A-Z0-9_]+:-([^}]*)\}")


def interpolate(value: str) -> str:
    """A compose string with every ${NAME:-default} replaced by its default."""
    return _INTERPOLATION.sub(lambda match: match.group(1), value)


def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return document


def compose_services(profile: str | None = None) -> dict[str, dict[str, Any]]:
    """Services that `docker compose --profile PROFILE up` starts (all when None)."""
    services: dict[str, dict[str, Any]] = compose()["services"]
    return {
        name: spec
        for name, spec in services.items()
        if profile is None or "profiles" not in spec or profile in spec["profiles"]
    }


def k8s_resources() -> list[dict[str, Any]]:
    """Every resource kustomization.yaml applies, plus the monitoring extras."""
    resources = []
    for path in sorted(K8S_DIR.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        resources += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return resources


def k8s_resource(kind: str, name: str) -> dict[str, Any]:
    matches = [
        resource
        for resource in k8s_resources()
        if resource["kind"] == kind and resource["metadata"]["name"] == name
    ]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    containers: list[dict[str, Any]] = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == name)


def env_values(container_spec: dict[str, Any]) -> dict[str, Any]:
    """name -> value, or name -> the valueFrom mapping."""
    return {
        item["name"]: item["value"] if "value" in item else item["valueFrom"]
        for item in container_spec.get("env", [])
    }


def container_port(container_spec: dict[str, Any], name: str) -> int:
    return int(next(p["containerPort"] for p in container_spec["ports"] if p["name"] == name))


def dockerfile_instructions(path: Path) -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        logical += stripped.removesuffix("\\").strip() + " "
        if not stripped.endswith("\\"):
            keyword, _, rest = logical.strip().partition(" ")
            yield keyword.upper(), rest.strip()
            logical = ""


def final_stage(path: Path) -> list[tuple[str, str]]:
    """The instructions of a Dockerfile's last stage, its FROM included."""
    instructions = list(dockerfile_instructions(path))
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def parse_duration_seconds(value: str) -> float:
    """Compose durations such as 20s, 1m30s."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", value)
    assert parts, f"not a duration: {value!r}"
    return sum(float(number) * units[unit] for number, unit in parts)
