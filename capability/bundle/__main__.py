"""Command line: build bundles, write their manifests, sign and verify them.

    python -m capability.bundle build --model topic-minilm --out build/models/topic-minilm/1
    python -m capability.bundle build --model topic-static --out build/models/topic-static/1
    python -m capability.bundle build --model topic-minilm --head linear-from-prototypes --out ...
    python -m capability.bundle build --model topic-static --out ... --sign-key KEY
    python -m capability.bundle manifest models/sentiment/1
    python -m capability.bundle sign build/models/topic-minilm/2 --key KEY
    python -m capability.bundle verify build/models/topic-minilm/1 [--trusted-signers FILE]
    python -m capability.bundle verify models/sentiment/1 --load

`manifest` writes manifest.json for a folder of a bundle's files built elsewhere.
`verify` checks every file against the manifest and parses config.json and
tokenizer.json; with `--load` it also loads the version as a server would, on the
CPU, so that it refuses what a server would, with the server's messages (the
folder's parent is taken for the model folder, whose name config.json must carry).

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
from capability.bundle.loader import check_bundle_metadata, write_bundle_manifest
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

    manifest = commands.add_parser(
        "manifest", help="write manifest.json for a folder holding a bundle's files"
    )
    manifest.add_argument("directory", type=Path)

    verify = commands.add_parser(
        "verify", help="check every file against manifest.json, and parse the config"
    )
    verify.add_argument("directory", type=Path)
    verify.add_argument("--quiet", action="store_true", help="no progress display")
    verify.add_argument(
        "--trusted-signers",
        type=Path,
        help="OpenSSH allowed-signers file; require manifest.json.sig by one of its keys",
    )
    verify.add_argument(
        "--load",
        action="store_true",
        help="also load and warm up the version on the CPU, as a server would",
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
                sign_key=args.sign_key,
            )
            print(out)
        elif args.command == "manifest":
            print(write_bundle_manifest(args.directory))
        elif args.command == "sign":
            print(sign_manifest(args.directory, args.key))
        else:
            print(_verify(args.directory, args.trusted_signers, args.load, not args.quiet))
    except (BundleError, ModelLoadError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _verify(directory: Path, trusted_signers: Path | None, load: bool, progress: bool) -> str:
    """The bundle's digest, once its files match the manifest, its config and tokenizer
    parse, and (`load`) a server would load it."""
    # The metadata first: it reads no weight file, and refuses a file no bundle holds
    # before verify_bundle would hash it, however large.
    check_bundle_metadata(directory, trusted_signers)
    digest = verify_bundle(directory, progress=progress, trusted_signers=trusted_signers)
    if load:
        # Imported here: the server's modules are needed by this option alone.
        from capability.trial_load import load_as_server

        load_as_server(directory, trusted_signers)
    return digest


if __name__ == "__main__":
    sys.exit(main())
