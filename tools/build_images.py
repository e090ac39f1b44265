"""Build the container images with their documented tags (needs a Docker engine with BuildKit).

    python tools/build_images.py capability [--bundles baked|mounted] [--cuda-version 12.8.1]
        [--torch-index-url URL] [--model topic-minilm] [--prefix registry/path/] [--dry-run]
    python tools/build_images.py orchestrator [--prefix registry/path/] [--dry-run]

Tags:
    capability, bundles baked    <model>:<weights sha12>-<git sha12>-cuda<major.minor>
                                 (topic-minilm:3f1c0a9be2d4-a358aa892985-cuda12.8)
    capability, bundles mounted  classify-capability:<git sha12>-cuda<major.minor>
    orchestrator                 classify-orchestrator:<git sha12>

The weights SHA is the digest of the model's bundle (the SHA-256 of its
manifest.json, which the server reports), and the git SHA the commit of the
code, so one tag names one set of weights and one version of the server on one
CUDA line: the bundles build byte for byte the same from any commit, and a tag
of the weights alone named every commit's image the same, so a code fix never
rolled out. A build from a working tree that differs from its commit (changed
or new files, which the build context carries) gets `-dirty` after the git
SHA, in the tags and the revision label. A baked image is built in two phases: the bundles stage is
built and exported first (`--target bundle-export`), its digest read, and
then the image is built with `WEIGHTS_SHA` set; BuildKit reuses the cached
bundles, and the Dockerfile refuses a bundle whose digest differs, so the
label and tag always match the weights inside. `--dry-run` prints the
commands instead of running them.
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CAPABILITY_DOCKERFILE = "deploy/docker/capability.Dockerfile"
ORCHESTRATOR_DOCKERFILE = "deploy/docker/orchestrator.Dockerfile"
DEFAULT_CUDA_VERSION = "12.8.1"
DEFAULT_MODEL = "topic-minilm"
EXPORT_DIR = Path("build/image-bundles")
SHORT_SHA = 12
DIRTY_SUFFIX = "-dirty"


def cuda_line(cuda_version: str) -> str:
    """12.8.1 -> 12.8: the tag names the CUDA line, the label the exact version."""
    parts = cuda_version.split(".")
    if len(parts) < 2 or not all(part.isdigit() for part in parts):
        raise ValueError(f"CUDA version {cuda_version!r} is not like 12.8.1")
    return f"{parts[0]}.{parts[1]}"


def torch_index_for(cuda_version: str) -> str:
    """PyTorch's wheel index for a CUDA line: 12.8.x -> .../whl/cu128."""
    major, minor = cuda_line(cuda_version).split(".")
    return f"https://download.pytorch.org/whl/cu{major}{minor}"


def capability_tag(model: str, weights_sha: str, revision: str, cuda_version: str) -> str:
    weights = weights_sha[:SHORT_SHA]
    return f"{model}:{weights}-{short_revision(revision)}-cuda{cuda_line(cuda_version)}"


def mounted_capability_tag(revision: str, cuda_version: str) -> str:
    return f"classify-capability:{short_revision(revision)}-cuda{cuda_line(cuda_version)}"


def orchestrator_tag(revision: str) -> str:
    return f"classify-orchestrator:{short_revision(revision)}"


def short_revision(revision: str) -> str:
    """`git_revision()` as a tag names it: the commit's first 12 hex digits, and
    `-dirty` when it has it."""
    sha, dirty, _ = revision.partition(DIRTY_SUFFIX)
    return sha[:SHORT_SHA] + dirty


def git_revision() -> str:
    """HEAD's commit, with DIRTY_SUFFIX when the working tree has changes or new files
    that git does not ignore: the build context carries them, so the image is not
    that commit's."""
    sha = _git("rev-parse", "HEAD").strip()
    return sha + DIRTY_SUFFIX if _git("status", "--porcelain").strip() else sha


def _git(*args: str) -> str:
    result = subprocess.run(
        ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True
    )
    return result.stdout


def build_args(values: dict[str, str]) -> list[str]:
    return [arg for name, value in values.items() for arg in ("--build-arg", f"{name}={value}")]


def run(command: list[str], dry_run: bool) -> None:
    print("+ " + shlex.join(command), flush=True)
    if not dry_run:
        subprocess.run(command, cwd=REPO_ROOT, check=True)


def build_capability(args: argparse.Namespace, revision: str) -> None:
    common = {
        "CUDA_VERSION": args.cuda_version,
        "TORCH_INDEX_URL": args.torch_index_url or torch_index_for(args.cuda_version),
        "BUNDLES": args.bundles,
        "MODEL": args.model,
    }
    dockerfile = ["-f", CAPABILITY_DOCKERFILE]
    if args.bundles == "mounted":
        tag = args.prefix + mounted_capability_tag(revision, args.cuda_version)
        final = {**common, "GIT_REVISION": revision}
        run(["docker", "build", *dockerfile, *build_args(final), "-t", tag, "."], args.dry_run)
        return
    export = REPO_ROOT / EXPORT_DIR
    if not args.dry_run:
        shutil.rmtree(export, ignore_errors=True)  # no stale bundle is read as this build's
    run(
        [
            "docker",
            "buildx",
            "build",
            *dockerfile,
            *build_args(common),
            "--target",
            "bundle-export",
            "--output",
            f"type=local,dest={EXPORT_DIR}",
            ".",
        ],
        args.dry_run,
    )
    manifest = export / args.model / "1" / "manifest.json"
    if args.dry_run:
        weights_sha = "<sha256 of " + str(manifest.relative_to(REPO_ROOT)) + ">"
        tag = (
            f"{args.prefix}{args.model}:<its first {SHORT_SHA}>-{short_revision(revision)}"
            f"-cuda{cuda_line(args.cuda_version)}"
        )
    else:
        weights_sha = hashlib.sha256(manifest.read_bytes()).hexdigest()
        tag = args.prefix + capability_tag(args.model, weights_sha, revision, args.cuda_version)
    final = {**common, "WEIGHTS_SHA": weights_sha, "GIT_REVISION": revision}
    run(["docker", "build", *dockerfile, *build_args(final), "-t", tag, "."], args.dry_run)


def build_orchestrator(args: argparse.Namespace, revision: str) -> None:
    tag = args.prefix + orchestrator_tag(revision)
    command = ["docker", "build", "-f", ORCHESTRATOR_DOCKERFILE]
    command += [*build_args({"GIT_REVISION": revision}), "-t", tag, "."]
    run(command, args.dry_run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image", choices=("capability", "orchestrator"))
    parser.add_argument("--bundles", choices=("baked", "mounted"), default="baked")
    parser.add_argument("--cuda-version", default=DEFAULT_CUDA_VERSION)
    parser.add_argument("--torch-index-url", default="", help="default: the CUDA line's index")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the image's model (baked)")
    parser.add_argument("--prefix", default="", help="registry and path, e.g. ghcr.io/acme/")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    try:
        cuda_line(args.cuda_version)
    except ValueError as error:
        parser.error(str(error))
    revision = git_revision()
    if args.image == "capability":
        build_capability(args, revision)
    else:
        build_orchestrator(args, revision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
