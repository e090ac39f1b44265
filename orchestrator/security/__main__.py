"""Create an API key: prints the key once, and the entry for the keys file.

python -m orchestrator.security new-key --id laptop --tenant acme [--role admin]
"""

from __future__ import annotations

import argparse

from orchestrator.security.keys import ROLES, hash_key, new_key, quoted_tenant


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.security")
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser("new-key", help="create a key and print its keys-file entry")
    create.add_argument("--id", required=True, help="label for logs")
    create.add_argument("--tenant", required=True)
    create.add_argument("--role", choices=ROLES, default="user")
    args = parser.parse_args()
    key = new_key()
    print(f"key (shown once; give it to the client): {key}")
    print("entry for the keys file, under `keys:`:")
    print(f"  - id: {quoted_tenant(args.id)}")  # a YAML string too: `on`, `#laptop`
    print(f"    sha256: {hash_key(key)}")
    print(f"    tenant: {quoted_tenant(args.tenant)}")
    print(f"    role: {args.role}")


if __name__ == "__main__":
    main()
