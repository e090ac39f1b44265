"""Command line: build and verify bundles.

    python -m capability.bundle build --model topic-minilm --out build/models/topic-minilm/1
    python -m capability.bundle build --model topic-static --out build/models/topic-static/1
    python -m capability.bundle build --model topic-minilm --head linear-from-prototypes --out ...
    python -m capability.bundle build --model topic-static --out ... --sign-key KEY
    python -m capability.bundle sign build/models/topic-minilm/2 --key KEY
    python -m capability.bundle verify build/models/topic-minilm/1 [--trusted-signers FILE]

Progress goes to stderr; the result (the bundle's path, or its digest) to stdout. Exit
status 1 means the bundle was refused or could not be written, with the reason on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from capability.bundle.builder import HEAD_CHOICES, MODEL_KINDS, build_bundle
from capability.bundle.errors import BundleError, ModelLoadError
from capability.bundle.manifest import verify_bundle
from capability.bundle.signing import sign_manifest
from capability.model import PRECISION_DTYPES


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m capability.bundle",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    build = commands.add_parser("build", help="write a new bundle version directory")
    build.add_argument("--model", required=True, choices=MODEL_KINDS)
    build.add_argument("--out", required=True, type=Path, help="version directory to create")
    build.add_argument("--head", default=HEAD_CHOICES[0], choices=HEAD_CHOICES)
    build.add_argument(
        "--precision",
        default="fp32",
        choices=sorted(PRECISION_DTYPES),
        help="the precision the bundle is served in unless the server overrides it",
    )
    build.add_argument(
        "--sign-key", type=Path, help="SSH private key to sign manifest.json with (none: unsigned)"
    )
    build.add_argument("--quiet", action="store_true", help="no progress display")

    sign = commands.add_parser("sign", help="sign a bundle's manifest.json (manifest.json.sig)")
    sign.add_argument("directory", type=Path)
    sign.add_argument("--key", required=True, type=Path, help="SSH private key file")

    verify = commands.add_parser("verify", help="check every file against manifest.json")
    verify.add_argument("directory", type=Path)
    verify.add_argument("--quiet", action="store_true", help="no progress display")
    verify.add_argument(
        "--trusted-signers",
        type=Path,
        help="OpenSSH allowed-signers file; require manifest.json.sig by one of its keys",
    )

    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            out = build_bundle(
                args.model,
                args.out,
                progress=not args.quiet,
                head=args.head,
                precision=args.precision,
            )
            if args.sign_key is not None:
                sign_manifest(out, args.sign_key)
            print(out)
        elif args.command == "sign":
            print(sign_manifest(args.directory, args.key))
        else:
            print(
                verify_bundle(
                    args.directory,
                    progress=not args.quiet,
                    trusted_signers=args.trusted_signers,
                )
            )
    except (BundleError, ModelLoadError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
