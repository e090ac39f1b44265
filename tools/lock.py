"""Resolve requirements/*.in into hash-pinned locks: `make lock` runs this, and only this.

    python tools/lock.py [--check] [--upgrade]

Each lock names every package its installed set needs, direct and transitive, as
`name==version --hash=sha256:...`, and is installed with

    pip install --require-hashes --no-deps -r requirements/X.lock

so nothing is resolved at install time and a file whose bytes differ from the ones
resolved here is refused. The versions and hashes come from the report of pip's own
resolver (`pip install --dry-run --report`), which records the sha256 of every file it
picked: the wheel for CPython 3.11 on Linux x86_64, as both images and our machines are.

- dev.lock is resolved first; the other sets are resolved under its pins as constraints,
  so a package has the same version and hash in every lock it appears in. A package
  the locks already pin keeps its version (given to dev's resolution as a constraint),
  so a new requirement adds itself and what it needs, and nothing else moves;
  `--upgrade` (`make lock-upgrade`) resolves everything afresh.
- Packages in requirements/no-deps.txt are resolved without their dependencies, at the
  pin given there, into every lock whose .in names them.
- torch goes into torch-cpu.lock alone and is installed in its own step: the build served
  here (`pip install torch==2.13.0`) is a CPU build from local disk whose hash is not
  that of any file on PyPI, and images take a CUDA build from PyTorch's index instead
  (docs/development.md#torch).
- Each lock's header carries the sha256 of the requirement files it was resolved from,
  so a test sees a lock that is out of date with its .in (`--check` does the same).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = REPO_ROOT / "requirements"
NO_DEPS_FILE = REQUIREMENTS / "no-deps.txt"
# dev first: its pins constrain the others.
LOCKED_SETS = ("dev", "orchestrator", "capability", "stubs", "pip")
# Installed in a step of their own, from a lock of their own: package -> (its lock, the set
# whose resolution pins it).
OWN_STEP = {"torch": ("torch-cpu", "capability")}
# The newest glibc a locked wheel may need: Ubuntu 22.04's, the capability image's base.
MAX_GLIBC = (2, 35)
# The build the locks expect each own-step package to resolve to (its local version label).
OWN_STEP_BUILD = {"torch": "cpu"}
INPUTS_LINE = "# Inputs (sha256 of the requirement files resolved): "


@dataclass(frozen=True, order=True)
class Pin:
    name: str
    version: str
    sha256: str
    url: str

    def line(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(line: str) -> str | None:
    """The distribution a requirement line names; None for blank lines, comments, options."""
    line = line.split("#", 1)[0].strip()
    if not line or line.startswith("-"):
        return None
    match = re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*", line)
    if match is None:
        raise SystemExit(f"cannot read a distribution name from {line!r}")
    return normalize(match.group(0))


def input_files(name: str) -> list[Path]:
    """X.in and every file it includes with -r, in the order read (no-deps.txt last)."""
    seen: list[Path] = []

    def visit(path: Path) -> None:
        if path in seen:
            return
        seen.append(path)
        for line in path.read_text().splitlines():
            include = re.match(r"^\s*(?:-r|--requirement)\s*(\S+)", line)
            if include:
                visit((path.parent / include.group(1)).resolve())

    visit((REQUIREMENTS / f"{name}.in").resolve())
    return [*seen, NO_DEPS_FILE]


def inputs_digest(name: str) -> str:
    """sha256 over the names and contents of the files X.lock is resolved from."""
    digest = hashlib.sha256()
    for path in input_files(name):
        digest.update(path.relative_to(REPO_ROOT).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def no_deps_pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in NO_DEPS_FILE.read_text().splitlines():
        name = requirement_name(line)
        if name is not None:
            pins[name] = line.split("#", 1)[0].strip()
    return pins


def requirement_lines(name: str) -> list[str]:
    """Every requirement line of X.in and its includes, flattened (-r lines dropped)."""
    return [
        line.split("#", 1)[0].strip()
        for path in input_files(name)[:-1]
        for line in path.read_text().splitlines()
        if requirement_name(line) is not None
    ]


def glibc_needed(filename: str) -> tuple[int, int] | None:
    """The glibc a manylinux wheel's tag asks for (None for pure and non-Linux wheels)."""
    legacy = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
    needs = [legacy[tag] for tag in legacy if f"{tag}_" in filename]
    needs += [(2, int(minor)) for minor in re.findall(r"manylinux_2_(\d+)_", filename)]
    # A wheel with several tags runs wherever any one of them does.
    return min(needs) if needs else None


def resolve(requirements: Iterable[str], constraints: Path | None, no_deps: bool) -> list[Pin]:
    """The packages pip's resolver picks for `requirements`, with the hash of each file."""
    requirements = list(requirements)
    if not requirements:
        return []
    with tempfile.TemporaryDirectory() as scratch:
        listed = Path(scratch) / "requirements.txt"
        listed.write_text("\n".join(requirements) + "\n")
        report = Path(scratch) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run"]
        command += ["--ignore-installed", "--only-binary=:all:", "--report", str(report)]
        command += ["-r", str(listed)]
        if constraints is not None:
            command += ["-c", str(constraints)]
        if no_deps:
            command.append("--no-deps")
        subprocess.run(command, check=True)
        installs = json.loads(report.read_text())["install"]
    pins = []
    for item in installs:
        info = item["download_info"]
        url = info["url"]
        sha256 = info.get("archive_info", {}).get("hashes", {}).get("sha256")
        if sha256 is None:
            raise SystemExit(f"pip's report gives no sha256 for {url}")
        filename = url.rsplit("/", 1)[-1]
        glibc = glibc_needed(filename)
        if glibc is not None and glibc > MAX_GLIBC:
            raise SystemExit(f"{filename} needs glibc {glibc}, newer than the images' {MAX_GLIBC}")
        name = normalize(item["metadata"]["name"])
        version, _, build = item["metadata"]["version"].partition("+")
        if name in OWN_STEP_BUILD and build != OWN_STEP_BUILD[name]:
            # Elsewhere pip finds PyPI's CUDA build, and the locks would fill with nvidia-*.
            raise SystemExit(
                f"{name} resolved to {filename}, not its +{OWN_STEP_BUILD[name]} build: run "
                "`make lock` where that build is served (docs/development.md#torch)"
            )
        # The local version label is dropped: "==2.13.0" matches the +cpu build.
        pins.append(Pin(name, version, sha256, url))
    return sorted(pins)


def render(name: str, pins: list[Pin], no_deps: list[Pin]) -> str:
    lines = [
        f"# Generated by `make lock` (tools/lock.py) from requirements/{name}.in;"
        " do not edit by hand.",
        f"{INPUTS_LINE}{inputs_digest(name)}",
        f"# Install with: pip install --require-hashes --no-deps -r requirements/{name}.lock",
    ]
    lines += [pin.line() for pin in pins]
    if no_deps:
        lines.append(f"# From {NO_DEPS_FILE.name} (installed without their declared dependencies):")
        lines += [pin.line() for pin in no_deps]
    return "\n".join(lines) + "\n"


def render_own_step(lock: str, pin: Pin, source: str) -> str:
    origin = pin.url if not pin.url.startswith("file:") else f"local disk, {pin.url}"
    return (
        f"# Generated by `make lock` (tools/lock.py) from requirements/{source}.in;"
        " do not edit by hand.\n"
        f"{INPUTS_LINE}{inputs_digest(source)}\n"
        f"# Install with: pip install --require-hashes --no-deps -r requirements/{lock}.lock\n"
        f"# NOTE: the hash is that of the file resolved on our machines ({origin}),\n"
        "# not of any file on PyPI: docs/development.md#torch says why it has its own lock.\n"
        f"{pin.line()}\n"
    )


def locked_versions(directory: Path) -> list[str]:
    """`name==version` of every package the locks in `directory` pin now."""
    pinned = []
    for lock in sorted(directory.glob("*.lock")):
        for line in lock.read_text().splitlines():
            match = re.match(r"([A-Za-z0-9._-]+)==([^\s;]+)", line)
            if match is not None:
                pinned.append(f"{normalize(match.group(1))}=={match.group(2)}")
    return sorted(set(pinned))


def write_locks(out: Path, keep: list[str] | None = None) -> None:
    """Resolve every set and write its lock (and the own-step locks) into `out`; `keep`
    (`name==version` lines) constrains dev's resolution, whose pins constrain the rest."""
    no_deps = no_deps_pins()
    own_step: dict[str, tuple[Pin, str]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        constraints: Path | None = None
        if keep:
            constraints = Path(scratch) / "kept-pins.txt"
            constraints.write_text("".join(f"{line}\n" for line in keep))
        for name in LOCKED_SETS:
            lines = requirement_lines(name)
            skipped = sorted({str(requirement_name(line)) for line in lines} & set(no_deps))
            resolved = [line for line in lines if requirement_name(line) not in skipped]
            pins = resolve(resolved, constraints, no_deps=False)
            unresolved = resolve([no_deps[skip] for skip in skipped], None, no_deps=True)
            for pin in pins:
                if pin.name in OWN_STEP and OWN_STEP[pin.name][1] == name:
                    own_step[pin.name] = (pin, name)
            kept = [pin for pin in pins if pin.name not in OWN_STEP]
            (out / f"{name}.lock").write_text(render(name, kept, unresolved))
            if name == LOCKED_SETS[0]:
                constraints = Path(scratch) / "dev-pins.txt"
                constraints.write_text("".join(f"{p.name}=={p.version}\n" for p in pins))
    for package, (lock, _) in OWN_STEP.items():
        pin, source = own_step[package]
        (out / f"{lock}.lock").write_text(render_own_step(lock, pin, source))


def stale_locks(directory: Path) -> list[str]:
    """Locks whose recorded inputs differ from the requirement files as they are now."""
    stale = []
    sources = {name: name for name in LOCKED_SETS} | dict(OWN_STEP.values())
    for name, source in sources.items():
        lock = directory / f"{name}.lock"
        recorded = [
            line[len(INPUTS_LINE) :]
            for line in (lock.read_text().splitlines() if lock.exists() else [])
            if line.startswith(INPUTS_LINE)
        ]
        if recorded != [inputs_digest(source)]:
            stale.append(f"requirements/{name}.lock")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="resolve nothing; exit 1 if a lock is out of date with its requirement files",
    )
    parser.add_argument(
        "--upgrade",
        action="store_true",
        help="resolve every package afresh (the newest releases the .in files allow); "
        "without it a package already locked keeps its version",
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_locks(REQUIREMENTS)
        for lock in stale:
            print(f"{lock} is out of date with its requirement files: run `make lock`")
        return 1 if stale else 0
    # NOTE: kept unless asked: adding one package took every other package's newest
    # patch release with it (grpcio among them), and each is a change to test.
    write_locks(REQUIREMENTS, None if args.upgrade else locked_versions(REQUIREMENTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
