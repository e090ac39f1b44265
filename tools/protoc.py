"""Compile the contract in proto/ offline: Python stubs for both layers, and images for buf.

No schema registry is reachable from our machines, so the one external import,
`buf/validate/validate.proto`, is taken from the descriptor that the
`protovalidate` wheel embeds. Written out as a FileDescriptorSet together with
the well-known types it imports, it lets `grpc_tools.protoc` resolve our
imports with `--descriptor_set_in`.

    python tools/protoc.py stubs [--proto-root proto] [--out classify_common/gen]
    python tools/protoc.py client-stubs [--proto-root proto] [--out DIR]
    python tools/protoc.py image [--proto-root proto] --out build/proto/image.binpb
    python tools/protoc.py image --against main --out build/proto/against.binpb

`stubs` writes `*_pb2.py`, `*_pb2_grpc.py` and their `.pyi` type stubs (from
mypy-protobuf) for our files and for `buf/validate/validate.proto`, which the
google.protobuf runtime needs to decode our field options. `client-stubs`
writes the same modules for the classify-client package (clients/python),
with their imports moved under `classify_client.gen`, so that the wheel
carries its own copy and needs neither the `.pth` nor top-level `ai` and
`buf` packages. `image` writes a
buf image (imports and source info included) that `buf lint` and
`buf breaking` read; with `--against` it builds the contract as it stands at
a git ref (or in another directory) and exits 3 when there is none there.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

from google.protobuf import any_pb2, descriptor_pb2, duration_pb2, field_mask_pb2, timestamp_pb2
from google.rpc import status_pb2
from grpc_tools import protoc
from protovalidate._gen.buf.validate import validate_pb

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROTO_ROOT = REPO_ROOT / "proto"
DEFAULT_STUB_DIR = REPO_ROOT / "classify_common" / "gen"
# The client package's source root (on the virtualenv's path through the .pth,
# as the wheel installs it) and its generated stubs, made by `make proto`.
CLIENT_SOURCE_DIR = REPO_ROOT / "clients" / "python" / "src"
CLIENT_PACKAGE = "classify_client"
DEFAULT_CLIENT_STUB_DIR = CLIENT_SOURCE_DIR / CLIENT_PACKAGE / "gen"
# The generated modules import each other as `ai.classify.v1...` and
# `buf.validate...`; in the client package they live under classify_client.gen.
_GENERATED_IMPORT = re.compile(r"^(\s*)(from|import) (ai|buf)\.", flags=re.MULTILINE)
VALIDATE_PROTO = "buf/validate/validate.proto"
# Written into site-packages so that `import ai.classify.v1...` and
# `import buf.validate...` resolve to the generated tree for every tool in the
# virtualenv (python -m, pytest, mypy).
PTH_FILE_NAME = "classify-generated-stubs.pth"


def write_dependency_set(path: Path) -> None:
    """Write validate.proto, google/rpc/status.proto (from googleapis-common-protos) and
    the well-known types they import as one FileDescriptorSet."""
    descriptor_set = descriptor_pb2.FileDescriptorSet()
    # Dependencies first: protoc resolves files in the order they are listed.
    for module in (
        any_pb2,
        descriptor_pb2,
        duration_pb2,
        field_mask_pb2,
        timestamp_pb2,
        status_pb2,
    ):
        descriptor_set.file.add().ParseFromString(module.DESCRIPTOR.serialized_pb)
    validate_file = validate_pb.desc()
    missing = {dep.name for dep in validate_file.dependencies} - {
        f.name for f in descriptor_set.file
    }
    if missing:
        raise SystemExit(f"protovalidate's validate.proto imports files we do not ship: {missing}")
    descriptor_set.file.add().ParseFromString(validate_file.proto.to_binary())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(descriptor_set.SerializeToString())


def find_proto_files(proto_root: Path) -> list[str]:
    files = sorted(p.relative_to(proto_root).as_posix() for p in proto_root.rglob("*.proto"))
    if not files:
        raise SystemExit(f"no .proto files under {proto_root}")
    return files


def run_protoc(args: list[str]) -> None:
    # grpc_tools.protoc.main takes argv including the program name.
    exit_code = protoc.main(["protoc", *args])
    if exit_code != 0:
        raise SystemExit(f"protoc failed (exit {exit_code})")


def find_plugin(name: str) -> str:
    """A protoc plugin installed beside this interpreter, else on PATH (an isolated
    build environment, as pip makes for the client wheel, puts its scripts there)."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found (it comes with mypy-protobuf)")
    return found


def generate_stubs(proto_root: Path, out_dir: Path, scratch_dir: Path) -> None:
    compile_stubs(proto_root, out_dir, scratch_dir)
    install_path_file(out_dir, CLIENT_SOURCE_DIR)


def generate_client_stubs(proto_root: Path, out_dir: Path, scratch_dir: Path) -> None:
    """The stubs for classify_client.gen: the same modules, importing each other there."""
    compile_stubs(proto_root, out_dir, scratch_dir)
    prefix = f"{CLIENT_PACKAGE}.{out_dir.name}."
    for module in [*out_dir.rglob("*.py"), *out_dir.rglob("*.pyi")]:
        text = module.read_text()
        module.write_text(_GENERATED_IMPORT.sub(rf"\1\2 {prefix}\3.", text))


def compile_stubs(proto_root: Path, out_dir: Path, scratch_dir: Path) -> None:
    dependency_set = scratch_dir / "dependencies.binpb"
    write_dependency_set(dependency_set)
    # Start clean so a deleted .proto leaves no stale module behind.
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    run_protoc(
        [
            f"--descriptor_set_in={dependency_set}",
            f"-I{proto_root}",
            f"--plugin=protoc-gen-mypy={find_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={find_plugin('protoc-gen-mypy_grpc')}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            f"--mypy_out={out_dir}",
            f"--mypy_grpc_out={out_dir}",
            *find_proto_files(proto_root),
            VALIDATE_PROTO,
        ]
    )
    # Namespace packages would do for imports, but explicit packages keep mypy
    # and the import system agreeing on module names.
    for directory in [p for p in out_dir.rglob("*") if p.is_dir()]:
        (directory / "__init__.py").touch()
    (out_dir / "README").write_text(
        "Generated from proto/ by tools/protoc.py (make proto). Do not edit; not committed.\n"
    )


def install_path_file(*directories: Path) -> None:
    site_packages = Path(sysconfig.get_paths()["purelib"])
    (site_packages / PTH_FILE_NAME).write_text(
        "".join(f"{directory.resolve()}\n" for directory in directories)
    )


def build_image(proto_root: Path, out_file: Path) -> None:
    dependency_set = out_file.parent / "dependencies.binpb"
    write_dependency_set(dependency_set)
    run_protoc(
        [
            f"--descriptor_set_in={dependency_set}",
            f"-I{proto_root}",
            "--include_imports",
            "--include_source_info",
            f"-o{out_file}",
            *find_proto_files(proto_root),
        ]
    )


NOTHING_TO_COMPARE = 3


def build_image_against(ref_or_dir: str, out_file: Path) -> None:
    """Build the image of the contract at a git ref, or in a directory, for `buf breaking`."""
    if Path(ref_or_dir).is_dir():
        build_image(Path(ref_or_dir), out_file)
        return
    proto_dir = DEFAULT_PROTO_ROOT.relative_to(REPO_ROOT).as_posix()
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", "--format=tar", ref_or_dir, proto_dir],
        capture_output=True,
    )
    if archive.returncode != 0:
        print(archive.stderr.decode().strip(), file=sys.stderr)
        raise SystemExit(NOTHING_TO_COMPARE)
    with tempfile.TemporaryDirectory() as scratch:
        tar_path = Path(scratch) / "proto.tar"
        tar_path.write_bytes(archive.stdout)
        with tarfile.open(tar_path) as tar:
            tar.extractall(scratch, filter="data")
        build_image(Path(scratch) / proto_dir, out_file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    stubs = sub.add_parser("stubs", help="generate Python stubs and type stubs")
    stubs.add_argument("--proto-root", type=Path, default=DEFAULT_PROTO_ROOT)
    stubs.add_argument("--out", type=Path, default=DEFAULT_STUB_DIR)
    client = sub.add_parser("client-stubs", help="generate the client package's stubs")
    client.add_argument("--proto-root", type=Path, default=DEFAULT_PROTO_ROOT)
    client.add_argument("--out", type=Path, default=DEFAULT_CLIENT_STUB_DIR)
    image = sub.add_parser("image", help="build a buf image for lint and breaking checks")
    source = image.add_mutually_exclusive_group()
    source.add_argument("--proto-root", type=Path, default=DEFAULT_PROTO_ROOT)
    source.add_argument("--against", metavar="REF_OR_DIR", help="git ref or directory")
    image.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    if args.command == "stubs":
        generate_stubs(args.proto_root, args.out, REPO_ROOT / "build" / "proto")
    elif args.command == "client-stubs":
        with tempfile.TemporaryDirectory() as scratch:
            generate_client_stubs(args.proto_root, args.out, Path(scratch))
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if args.against:
            build_image_against(args.against, args.out)
        else:
            build_image(args.proto_root, args.out)


if __name__ == "__main__":
    main()
