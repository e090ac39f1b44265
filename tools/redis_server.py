"""A Redis server for the tests, from Debian's packages, without root.

    python -m tools.redis_server install build/tools/redis

Debian ships Redis 7.0's server as the `redis-check-rdb` binary of `redis-tools`
(`redis-server` is the same binary under another name: it picks its mode from
the name it is run as). `install` downloads `redis-tools` and the two libraries
it links (`libjemalloc2`, `liblzf1`) with `apt-get download`, unpacks them with
`dpkg-deb -x` (as tools/deploy_check.py does for promtool, refreshing apt's lists
in a private folder when it must), and leaves in the target folder:

    redis-server   a script that runs the binary under that name with
                   LD_LIBRARY_PATH pointing at the unpacked libraries
    libexec/       the binary (as redis-server) and the libraries

Tests start it on a free loopback port (tests/redis_fixtures.py); `make pytest`
installs it first, and the fixture installs it when it is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tools.deploy_check import apt_download, private_apt_options

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TARGET = REPO_ROOT / "build" / "tools" / "redis"
PACKAGES = ("redis-tools", "libjemalloc2", "liblzf1")
LAUNCHER = """#!/bin/sh
# Debian's redis-check-rdb run as redis-server (tools/redis_server.py made this).
here="$(dirname "$0")/libexec"
LD_LIBRARY_PATH="$here${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/redis-server" "$@"
"""


def server_path(target: Path = DEFAULT_TARGET) -> Path:
    return target / "redis-server"


def download(packages: Sequence[str], into: Path) -> bool:
    """Every package's .deb into `into`; refreshes apt's lists once if one is missing."""
    if all(apt_download(package, into) for package in packages):
        return True
    options = private_apt_options(into / "apt") if os.geteuid() != 0 else []
    print("apt-get download failed; refreshing package lists", flush=True)
    update = subprocess.run(["apt-get", *options, "-qq", "update"], capture_output=True)
    return update.returncode == 0 and all(
        any(into.glob(f"{package}_*.deb")) or apt_download(package, into, options)
        for package in packages
    )


def install(target: Path) -> int:
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        if not download(PACKAGES, scratch):
            print(f"cannot download Debian's {', '.join(PACKAGES)}", file=sys.stderr)
            return 1
        extracted = scratch / "root"
        for deb in sorted(scratch.glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(extracted)], check=True)
        libexec = target / "libexec"
        shutil.rmtree(libexec, ignore_errors=True)
        libexec.mkdir(parents=True)
        shutil.copy2(extracted / "usr" / "bin" / "redis-check-rdb", libexec / "redis-server")
        for library in (extracted / "usr" / "lib").rglob("*.so*"):
            shutil.copy2(library, libexec / library.name, follow_symlinks=True)
        launcher = server_path(target)
        launcher.write_text(LAUNCHER)
        launcher.chmod(0o755)
        version = subprocess.run([launcher, "--version"], capture_output=True, text=True)
        if version.returncode != 0:
            print(f"the unpacked server does not run: {version.stderr}", file=sys.stderr)
            return 1
        print(f"{launcher}: {version.stdout.strip()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.redis_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    install_command = commands.add_parser("install", help="redis-server from Debian's packages")
    install_command.add_argument("target", type=Path, nargs="?", default=DEFAULT_TARGET)
    args = parser.parse_args(argv)
    return install(args.target)


if __name__ == "__main__":
    sys.exit(main())
