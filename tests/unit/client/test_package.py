"""classify-client declares what its code imports, at the versions its generated code needs."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

from tests.conftest import REPO_ROOT

CLIENT_DIR = REPO_ROOT / "clients" / "python"
PACKAGE_DIR = CLIENT_DIR / "src" / "classify_client"
GENERATED_DIR = PACKAGE_DIR / "gen"
REQUIREMENTS_DIR = REPO_ROOT / "requirements"
# The distribution behind each third-party module the package's code imports.
DISTRIBUTION_BY_MODULE = {
    "grpc": "grpcio",
    "google.protobuf": "protobuf",
    "google.rpc": "googleapis-common-protos",
}


def declared(table: str = "project", key: str = "dependencies") -> dict[str, str]:
    """Each requirement's name and its version specifier, as written."""
    config = tomllib.loads((CLIENT_DIR / "pyproject.toml").read_text())
    requirements: dict[str, str] = {}
    for line in config[table][key]:
        match = re.fullmatch(r"([A-Za-z0-9._-]+)(.*)", line)
        assert match is not None, line
        requirements[match.group(1)] = match.group(2)
    return requirements


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def test_the_declared_dependencies_are_exactly_what_the_code_and_its_stubs_import() -> None:
    needed: set[str] = set()
    for path in PACKAGE_DIR.rglob("*.py"):
        for module in imported_modules(path):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or top == "classify_client":
                continue
            owner = next(
                (m for m in DISTRIBUTION_BY_MODULE if f"{module}.".startswith(f"{m}.")), None
            )
            assert owner is not None, f"{path.relative_to(REPO_ROOT)} imports {module}"
            needed.add(DISTRIBUTION_BY_MODULE[owner])
    assert set(declared()) == needed


def test_the_lower_bounds_are_the_versions_the_stubs_were_generated_for() -> None:
    stub = (GENERATED_DIR / "ai" / "classify" / "v1" / "classify_service_pb2.py").read_text()
    grpc_stub = (
        GENERATED_DIR / "ai" / "classify" / "v1" / "classify_service_pb2_grpc.py"
    ).read_text()
    protobuf_version = re.search(r"^# Protobuf Python Version: (\S+)$", stub, re.MULTILINE)
    grpc_version = re.search(r"^GRPC_GENERATED_VERSION = '(\S+)'$", grpc_stub, re.MULTILINE)
    assert protobuf_version is not None
    assert grpc_version is not None
    protobuf, grpcio = protobuf_version.group(1), grpc_version.group(1)
    major = int(protobuf.split(".")[0])
    requirements = declared()
    assert requirements["protobuf"] == f">={protobuf},<{major + 1}"
    assert requirements["grpcio"] == f">={grpcio}"
    # The generator an isolated build installs is the one that made these stubs.
    assert declared("build-system", "requires")["grpcio-tools"] == f"=={grpcio}"


def test_the_common_protos_lower_bound_is_the_locked_release_that_allows_protobuf_7() -> None:
    """googleapis-common-protos 1.70 to 1.73 require protobuf<7: a bound below the
    locked release let pip pick one that cannot be installed beside the stubs' protobuf."""
    (locked,) = re.findall(
        r"^googleapis-common-protos==(\S+) ", (REQUIREMENTS_DIR / "dev.lock").read_text(), re.M
    )
    assert declared()["googleapis-common-protos"] == f">={locked}"
    assert declared("build-system", "requires")["googleapis-common-protos"] == f">={locked}"


def test_the_package_names_its_version_and_a_typing_extra_with_the_locked_stubs() -> None:
    """Without types-grpcio and types-protobuf, mypy --strict saw a response's fields and
    ClassifyError.code as Any; nothing said to install them."""
    import classify_client

    config = tomllib.loads((CLIENT_DIR / "pyproject.toml").read_text())
    assert classify_client.__version__ == config["project"]["version"]
    locked = (REQUIREMENTS_DIR / "dev.lock").read_text()
    extra = config["project"]["optional-dependencies"]["typing"]
    pinned = dict(re.findall(r"^(types-grpcio|types-protobuf)==(\S+) ", locked, re.M))
    assert extra == [f"{name}>={version}" for name, version in sorted(pinned.items())]
