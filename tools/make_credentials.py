"""Create, once, the credentials a deployment needs, in one folder.

    python tools/make_credentials.py DIR [--tenant local] [--rate 200] [--burst 400]
        [--owner UID:GID] [--token-copy DIR]

Writes, each only if it is missing (so a restart keeps the keys clients hold):
    api-key          a new API key (user role), for the client: give it out, keep it secret
    api-keys.yaml    the orchestrator's --api-keys-file: that key's SHA-256, tenant and role,
                     and the tenant's rate limit
    internal-token   the token the orchestrator sends and capability servers require
                     (--internal-token-file on both)

With --token-copy, the internal token is also written (kept equal to DIR's)
into a folder of its own, for the capability servers: they need nothing else,
and a server that can read the client's API key could call the front door.
Files are mode 0600, owned by --owner when given. The compose stack runs this
once in a `credentials` service, into a volume the orchestrator mounts and a
token-only volume the capability servers mount; on Kubernetes, run it on your
machine and create the Secrets from the folder (deploy/README.md). More keys:
`python -m orchestrator.security new-key`.
"""

from __future__ import annotations

import argparse
import errno
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from classify_common.settings import spoken_number  # noqa: E402
from orchestrator.security import (  # noqa: E402
    TokenBucketSettings,
    hash_key,
    new_key,
    quoted_tenant,
)

API_KEY_FILE = "api-key"
API_KEYS_FILE = "api-keys.yaml"
INTERNAL_TOKEN_FILE = "internal-token"


def keys_file_text(key: str, tenant: str, rate_per_second: float, burst: int) -> str:
    name = quoted_tenant(tenant)
    # NOTE: not :g, whose 1e-07 YAML reads as a string and 1.23457e+06 rounds the rate.
    rate = spoken_number(rate_per_second)
    # `keys` comes last, so that an entry `new-key` prints, appended to the file (as
    # deploy/README.md shows), lands in its list; after `tenants`, it broke the file.
    return (
        "# Made by tools/make_credentials.py. Add keys with "
        "`python -m orchestrator.security new-key`\n"
        "# and append its entry: `keys` stays the last section of this file.\n"
        "tenants:\n"
        f"  {name}: {{rate_per_second: {rate}, burst: {burst}}}\n"
        "keys:\n"
        f"  - id: {quoted_tenant(tenant + '-1')}\n    sha256: {hash_key(key)}\n"
        f"    tenant: {name}\n    role: user\n"
    )


def write_private(
    path: Path, text: str, owner: tuple[int, int] | None = None, *, replace: bool = False
) -> None:
    """Write `text` to a new file `path` (with `replace`, a new or existing one), 0600
    from the start: written and then narrowed, it was readable by others in between,
    and for good if stopped there."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if replace else os.O_EXCL)
    descriptor = os.open(path, flags, 0o600)
    os.fchmod(descriptor, 0o600)  # an existing file keeps its mode through O_CREAT
    with os.fdopen(descriptor, "w") as stream:
        stream.write(text)
    if owner is not None:
        os.chown(path, *owner)


def make_credentials(
    directory: Path,
    tenant: str,
    rate_per_second: float,
    burst: int,
    owner: tuple[int, int] | None = None,
) -> list[str]:
    """Create the missing files; returns the names created."""
    if directory.exists() and not directory.is_dir():
        # mkdir's own refusal of it says "File exists", which reads as if all were done.
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(directory))
    directory.mkdir(parents=True, exist_ok=True)
    created = []
    if not (directory / API_KEY_FILE).is_file() or not (directory / API_KEYS_FILE).is_file():
        for name in (API_KEY_FILE, API_KEYS_FILE):
            (directory / name).unlink(missing_ok=True)  # a key and its hash come as a pair
        key = new_key()
        write_private(directory / API_KEY_FILE, key + "\n", owner)
        write_private(
            directory / API_KEYS_FILE, keys_file_text(key, tenant, rate_per_second, burst), owner
        )
        created += [API_KEY_FILE, API_KEYS_FILE]
    if not (directory / INTERNAL_TOKEN_FILE).is_file():
        write_private(directory / INTERNAL_TOKEN_FILE, secrets.token_urlsafe(32) + "\n", owner)
        created.append(INTERNAL_TOKEN_FILE)
    return created


def copy_token(directory: Path, token_folder: Path, owner: tuple[int, int] | None) -> bool:
    """Make `token_folder`'s internal token the same as `directory`'s; True when written."""
    token = (directory / INTERNAL_TOKEN_FILE).read_text()
    copy = token_folder / INTERNAL_TOKEN_FILE
    token_folder.mkdir(parents=True, exist_ok=True)
    if copy.is_file() and copy.read_text() == token:
        return False
    copy.unlink(missing_ok=True)
    write_private(copy, token, owner)
    return True


def parse_owner(value: str) -> tuple[int, int]:
    user, _, group = value.partition(":")
    try:
        return int(user), int(group or user)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not UID[:GID]") from None


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--tenant", default="local")
    parser.add_argument("--rate", type=float, default=200.0, help="tenant calls per second")
    parser.add_argument("--burst", type=int, default=400, help="tenant burst, in calls")
    parser.add_argument("--owner", type=parse_owner, help="UID[:GID] to own the files")
    parser.add_argument(
        "--token-copy", type=Path, help="a folder to hold a copy of the internal token alone"
    )
    args = parser.parse_args(argv)
    try:
        # The orchestrator's own rule for a tenant's limit: a keys file it would refuse
        # (a rate of -5, say) is never written.
        TokenBucketSettings(args.rate, args.burst)
    except ValueError as exc:
        parser.error(f"--rate / --burst: {exc}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_arguments(argv)
    try:
        created = make_credentials(args.directory, args.tenant, args.rate, args.burst, args.owner)
        for name in created:
            print(f"created {args.directory / name}")
        if args.token_copy is not None and copy_token(args.directory, args.token_copy, args.owner):
            created.append(INTERNAL_TOKEN_FILE)
            print(f"created {args.token_copy / INTERNAL_TOKEN_FILE}")
    except OSError as exc:  # a file or folder in the way, or one it may not write
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    if not created:
        print(f"{args.directory}: credentials already there; nothing changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
