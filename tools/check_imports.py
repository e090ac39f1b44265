"""Every third-party import is declared, and each image installs exactly what its code imports.

    python tools/check_imports.py [--root DIR] [--list]

For each installed set below (the development virtualenv, the two images and the stage that
generates stubs), the Python files that run there are parsed and every absolute import is
traced to the distribution that provides it, using the RECORD files of the distributions
installed in this interpreter's environment (so `google.rpc` is googleapis-common-protos, not
protobuf). The check fails, naming the file and line, when

- an import is provided only by distributions not declared in the set's `requirements/*.in`
  (followed through `-r`): a transitive dependency is not a declaration, since any upgrade
  of its parent may drop it;
- an import is provided by no installed distribution at all;
- an image's `.in` declares a distribution that none of the image's code imports, so an
  image never installs what only the other one needs (the orchestrator's lock has no torch).

`--list` prints, per set, the distributions its code imports. Prints one "ok" line per set.
Only the standard library is used: this runs before anything is known to be declared.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.metadata
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

REPO_ROOT = Path(__file__).resolve().parent.parent
# Our own top-level packages, the client package's, and the two the generated stubs add
# (classify_common/gen).
FIRST_PARTY = frozenset(
    {
        *("capability", "orchestrator", "classify_common", "classify_client"),
        *("tools", "tests", "bench", "ai", "buf"),
    }
)
CODE_SUFFIXES = (".py", ".pyi", ".so", ".pyd")


@dataclass(frozen=True)
class InstalledSet:
    """Code that runs in one environment, and the requirements file that declares its packages."""

    name: str
    requirements: str
    # Files and folders (relative to the repository) whose imports must be declared.
    sources: tuple[str, ...]
    # Whether every declared distribution must be imported by `sources` (for the images,
    # which should carry nothing they do not run).
    every_declaration_imported: bool = False
    # Declared distributions that are used without being imported, and why.
    used_without_import: Mapping[str, str] = field(default_factory=dict)


INSTALLED_SETS = (
    InstalledSet(
        name="dev",
        requirements="requirements/dev.in",
        sources=(
            *("capability", "orchestrator", "classify_common", "tests", "tools", "bench"),
            "clients/python/src/classify_client",
        ),
    ),
    # What deploy/docker/orchestrator.Dockerfile copies into its image.
    InstalledSet(
        name="orchestrator image",
        requirements="requirements/orchestrator.in",
        sources=("orchestrator", "classify_common", "tools/grpc_health_check.py"),
        every_declaration_imported=True,
    ),
    # What deploy/docker/capability.Dockerfile copies into its image.
    InstalledSet(
        name="capability image",
        requirements="requirements/capability.in",
        sources=("capability", "classify_common", "tools/grpc_health_check.py"),
        every_declaration_imported=True,
        used_without_import={
            "numpy": "torch sets up its NumPy bridge at import, and warns on every start without it"
        },
    ),
    # The throwaway virtualenv in which both Dockerfiles generate the stubs.
    InstalledSet(
        name="stub generation",
        requirements="requirements/stubs.in",
        sources=("tools/protoc.py",),
        every_declaration_imported=True,
        used_without_import={"mypy-protobuf": "protoc plugin (protoc-gen-mypy) writing the .pyi"},
    ),
)

# Files that never run in any of the sets above.
NOT_CHECKED = {
    # Runs once, by hand, in its own throwaway virtualenv with sentence-transformers.
    "tests/data/reference/make_reference_embeddings.py",
}


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them (PyYAML, pyyaml and py_yaml are one)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_in(path: Path) -> set[str]:
    """Distribution names a requirements file lists, following `-r` includes."""
    names: set[str] = set()
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        include = re.match(r"^(?:-r|--requirement)\s*(\S+)$", line)
        if include:
            names |= declared_in(path.parent / include.group(1))
            continue
        if line.startswith("-"):
            continue
        name = re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*", line)
        if name is None:
            raise SystemExit(f"{path}: cannot read a distribution name from {raw!r}")
        names.add(normalize(name.group(0)))
    return names


def modules_of(files: Iterable[str]) -> Iterator[str]:
    """Dotted module (and package) names a distribution's installed files provide."""
    for file in files:
        parts = file.split("/")
        if not parts or parts[0] == ".." or parts[0].endswith((".dist-info", ".data")):
            continue
        folders, leaf = parts[:-1], parts[-1]
        if leaf.endswith(CODE_SUFFIXES):
            stem = leaf.split(".", 1)[0]
            names = [*folders] if stem == "__init__" else [*folders, stem]
        else:
            names = [*folders]  # a data file still shows that its folders are packages
        for depth in range(1, len(names) + 1):
            if not all(part.isidentifier() for part in names[:depth]):
                break
            yield ".".join(names[:depth])


def module_providers() -> dict[str, set[str]]:
    """Every importable module name of this environment → the distributions that install it."""
    providers: dict[str, set[str]] = {}
    for distribution in importlib.metadata.distributions():
        name = normalize(distribution.metadata["Name"])
        files = (PurePosixPath(file).as_posix() for file in distribution.files or ())
        for module in set(modules_of(files)):
            providers.setdefault(module, set()).add(name)
    return providers


@dataclass(frozen=True)
class Import:
    path: str
    line: int
    name: str  # as written: `google.rpc.status_pb2` for `from google.rpc import status_pb2`
    # Candidate module names, most specific first (`from a.b import c` may import a.b.c).
    candidates: tuple[str, ...]


def statements(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every statement, however nested (an import is a statement, never inside an expression)."""
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        yield node
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, name, None)
            if isinstance(children, list):
                stack.extend(children)


@functools.cache
def imports_in(path: Path, relative: str) -> tuple[Import, ...]:
    """Absolute imports of one file that are neither standard library nor ours."""
    found = _imports_in(ast.parse(path.read_text(), filename=relative), relative)
    return tuple(sorted(found, key=lambda item: item.line))


def _imports_in(tree: ast.Module, relative: str) -> Iterator[Import]:
    for node in statements(tree.body):
        if isinstance(node, ast.Import):
            modules = [[alias.name] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [[f"{node.module}.{alias.name}", node.module] for alias in node.names]
        else:
            continue
        for names in modules:
            top = names[-1].split(".", 1)[0]
            if top in sys.stdlib_module_names or top in FIRST_PARTY:
                continue
            candidates: list[str] = []
            for name in names:
                parts = name.split(".")
                candidates += [".".join(parts[:depth]) for depth in range(len(parts), 0, -1)]
            yield Import(relative, node.lineno, names[0], tuple(dict.fromkeys(candidates)))


def python_files(root: Path, sources: Iterable[str]) -> Iterator[tuple[Path, str]]:
    for source in sources:
        base = root / source
        paths = [base] if base.is_file() else sorted(base.rglob("*.py"))
        for path in paths:
            relative = path.relative_to(root).as_posix()
            if relative not in NOT_CHECKED and "__pycache__" not in path.parts:
                yield path, relative


def provider_of(item: Import, providers: Mapping[str, set[str]]) -> set[str]:
    for candidate in item.candidates:
        if candidate in providers:
            return providers[candidate]
    return set()


def check(
    root: Path, installed: InstalledSet, providers: Mapping[str, set[str]]
) -> tuple[list[str], set[str]]:
    """Problems found in one installed set, and the declared distributions its code imports."""
    declared = declared_in(root / installed.requirements)
    problems: list[str] = []
    imported: set[str] = set()
    for path, relative in python_files(root, installed.sources):
        for item in imports_in(path, relative):
            found = provider_of(item, providers)
            module = item.name
            if not found:
                problems.append(
                    f"{item.path}:{item.line}: {module!r} is installed by no distribution here"
                )
            elif found & declared:
                imported |= found & declared
            else:
                problems.append(
                    f"{item.path}:{item.line}: imports {module!r} from "
                    f"{', '.join(sorted(found))}, not declared in {installed.requirements}"
                )
    if installed.every_declaration_imported:
        unused = declared - imported - set(installed.used_without_import)
        problems += [
            f"{installed.requirements}: declares {name}, which no file of the "
            f"{installed.name} imports ({', '.join(installed.sources)})"
            for name in sorted(unused)
        ]
    return problems, imported


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="repository to check")
    parser.add_argument("--list", action="store_true", help="print what each set imports")
    args = parser.parse_args(argv)
    providers = module_providers()
    failed = False
    for installed in INSTALLED_SETS:
        problems, imported = check(args.root, installed, providers)
        if args.list:
            print(f"{installed.name} imports: {', '.join(sorted(imported))}")
        for problem in problems:
            print(f"check-imports ({installed.name}): {problem}", file=sys.stderr)
        if problems:
            failed = True
        else:
            print(f"check-imports ({installed.name}): ok, every import declared")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
