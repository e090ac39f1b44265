"""A bundle's digest stands for what is served: exactly the listed files, as they were
when they were checked.

What is served is parsed from the very bytes that were hashed, so a weight file swapped
after verification, or rewritten in place while its version serves, changes no answer.
And the folder holds nothing but its listed files, manifest.json and manifest.json.sig,
each a regular file: anything else is refused naming it.

The bundles are copies of the session's built topic-static (tests/conftest.py). Copies
that are only read or renamed in are hard links; one whose file is rewritten in place
is a real copy, so the shared bundle is never written through.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.bundle import (
    STAGES,
    BundleHashMismatch,
    UnexpectedBundleFile,
    load_bundle,
    verify_bundle,
    write_manifest,
)
from capability.memory import MemoryReading, read_memory
from tests.conftest import STRIKER, StartCapability

MODEL = "topic-static"
EMBEDDINGS = "embeddings.safetensors"
HEAD = "head.safetensors"
ONLY_LISTED = "a bundle holds only its listed files, manifest.json and manifest.json.sig"
NOT_REGULAR = "a bundle is one folder of regular files, so that what its manifest vouches for"


def linked_copy(model_root: Path, tmp_path: Path) -> Path:
    """Version 1 of topic-static under `<tmp>/models`, every file a hard link."""
    copy = tmp_path / "models" / MODEL / "1"
    shutil.copytree(model_root / MODEL / "1", copy, copy_function=os.link)
    return copy


def real_copy(model_root: Path, tmp_path: Path) -> Path:
    """Version 1 of topic-static under `<tmp>/models`, files of its own to write through."""
    copy = tmp_path / "models" / MODEL / "1"
    shutil.copytree(model_root / MODEL / "1", copy)
    return copy


def rotate_rows_in_place(path: Path, rows: int = 1000) -> None:
    """Rewrite a safetensors file's tensor data through the same inode: every value
    kept, rows moved by `rows` (the header, and so the file's validity, unchanged)."""
    row_bytes = 384 * 4  # one float32 word vector
    with path.open("r+b") as stream:
        data_start = 8 + int.from_bytes(stream.read(8), "little")
        stream.seek(data_start)
        data = stream.read()
        shift = rows * row_bytes
        stream.seek(data_start)
        stream.write(data[shift:] + data[:shift])


def rotated_head(path: Path, into: Path) -> Path:
    """A valid head of the same size whose label prototypes are moved one label along:
    a sports headline scores as another label."""
    tensors = load_file(path)
    rotated = {key: torch.roll(t, 1, dims=0).contiguous() for key, t in tensors.items()}
    save_file(rotated, into, metadata={"format": "pt"})  # the builder's own metadata
    return into


async def classify(server_port: int) -> list[tuple[str, float]]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server_port}") as channel:
        response = await classify_service_pb2_grpc.ClassifyServiceStub(channel).Classify(
            pb.ClassifyRequest(text=STRIKER, model=MODEL)
        )
    return [(label.name, label.score) for label in response.labels]


# What was verified is what is served.


async def test_weights_rewritten_in_place_while_serving_change_no_answer(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    bundle = real_copy(model_root, tmp_path)
    server = await start_capability(model_root=bundle.parent.parent, models=(MODEL,))
    before = await classify(server.port)
    inode = (bundle / EMBEDDINGS).stat().st_ino

    rotate_rows_in_place(bundle / EMBEDDINGS)

    assert (bundle / EMBEDDINGS).stat().st_ino == inode  # the same file, written through
    assert await classify(server.port) == before
    assert before[0][0] == "sports"
    # The control: the rewritten file does change answers once it is loaded.
    write_manifest(bundle)
    rewritten = load_bundle(bundle).classifier
    top = int(rewritten.classify([STRIKER]).probabilities[0].argmax())
    assert rewritten.labels[top].name != "sports"


class SwapAsLoadingBegins:
    """A LoadWatch (capability.memory) that renames `replacement` over `target` as the
    load_weights stage begins: after verify has checked every file, before any weight
    is parsed. The loader reads the watch before and after each stage in STAGES order,
    so the read that opens load_weights is known exactly: the swap lands between the
    hash and the load every time, with nothing raced."""

    def __init__(self, target: Path, replacement: Path) -> None:
        self.target, self.replacement = target, replacement
        self.swap_at_read = 2 * STAGES.index("load_weights") + 1
        self.reads = 0
        self.swapped = False

    def read(self) -> MemoryReading:
        self.reads += 1
        if self.reads == self.swap_at_read:
            os.replace(self.replacement, self.target)
            self.swapped = True
        return read_memory(torch.device("cpu"))

    def admit_weights(self, weights_bytes: int) -> None:
        """Any size fits: this watch measures nothing."""


def test_weight_file_swapped_after_verification_is_not_what_loads(
    model_root: Path, tmp_path: Path
) -> None:
    genuine = load_bundle(model_root / MODEL / "1", graph="eager")
    bundle = linked_copy(model_root, tmp_path)
    swap = SwapAsLoadingBegins(
        bundle / HEAD, rotated_head(bundle / HEAD, tmp_path / "rotated-head.safetensors")
    )

    loaded = load_bundle(bundle, graph="eager", watch=swap)

    assert swap.swapped
    assert loaded.digest == genuine.digest
    assert torch.equal(
        loaded.classifier.classify([STRIKER]).probabilities,
        genuine.classifier.classify([STRIKER]).probabilities,
    )
    # The folder as it is now holds the swapped head, which its manifest refuses.
    with pytest.raises(BundleHashMismatch, match=r"^head\.safetensors: SHA-256 "):
        verify_bundle(bundle)


# Nothing but the listed files, each a regular file.


def add_unlisted_file(name: str) -> Callable[[Path], None]:
    def add(bundle: Path) -> None:
        (bundle / name).write_bytes(b"{}\n")

    return add


def add_subdirectory_with_weights(bundle: Path) -> None:
    (bundle / "more").mkdir()
    shutil.copyfile(bundle / EMBEDDINGS, bundle / "more" / EMBEDDINGS)


def add_upper_case_head(bundle: Path) -> None:
    shutil.copyfile(bundle / HEAD, bundle / "HEAD.SAFETENSORS")


def link_listed_file_outside(name: str) -> Callable[[Path], None]:
    """`name` moved out of the model root, and a symbolic link to it left in its place:
    the bytes are the listed ones, but they do not live in the bundle."""

    def link(bundle: Path) -> None:
        outside = bundle.parent.parent.parent / "outside"
        outside.mkdir()
        shutil.move(bundle / name, outside / name)
        (bundle / name).symlink_to(outside / name)

    return link


def replace_listed_file_with_fifo(bundle: Path) -> None:
    (bundle / "tokenizer.json").unlink()
    os.mkfifo(bundle / "tokenizer.json")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param(
            add_unlisted_file("payload.py"),
            f"payload.py: a file not listed in manifest.json; {ONLY_LISTED}",
            id="unlisted-payload.py",
        ),
        pytest.param(
            add_unlisted_file("tokenizer_config.json"),
            f"tokenizer_config.json: a file not listed in manifest.json; {ONLY_LISTED}",
            id="unlisted-tokenizer_config.json",
        ),
        pytest.param(
            add_subdirectory_with_weights,
            f"more: a directory; {NOT_REGULAR} lies in the folder",
            id="subdirectory-holding-weights",
        ),
        pytest.param(
            add_upper_case_head,
            f"HEAD.SAFETENSORS: a weight file not listed in manifest.json; {ONLY_LISTED}",
            id="upper-case-weight-file",
        ),
        pytest.param(
            link_listed_file_outside(EMBEDDINGS),
            f"{EMBEDDINGS}: a symbolic link; {NOT_REGULAR} lies in the folder",
            id="listed-file-linked-outside",
        ),
        pytest.param(
            link_listed_file_outside("manifest.json.sig"),
            f"manifest.json.sig: a symbolic link; {NOT_REGULAR} lies in the folder",
            id="signature-linked-outside",
        ),
        pytest.param(
            replace_listed_file_with_fifo,
            f"tokenizer.json: a FIFO; {NOT_REGULAR} lies in the folder",
            id="listed-file-a-fifo",
        ),
    ],
)
def test_anything_but_the_listed_regular_files_is_refused_naming_it(
    model_root: Path, tmp_path: Path, change: Callable[[Path], None], message: str
) -> None:
    bundle = linked_copy(model_root, tmp_path)
    (bundle / "manifest.json.sig").write_bytes(b"not checked without trusted signers\n")
    change(bundle)

    with pytest.raises(UnexpectedBundleFile) as verified:
        verify_bundle(bundle)
    with pytest.raises(UnexpectedBundleFile) as loaded:
        load_bundle(bundle)

    assert str(verified.value) == message
    assert str(loaded.value) == message


def test_manifest_that_is_a_symbolic_link_is_refused_naming_it(
    model_root: Path, tmp_path: Path
) -> None:
    bundle = linked_copy(model_root, tmp_path)
    link_listed_file_outside("manifest.json")(bundle)

    with pytest.raises(UnexpectedBundleFile) as refused:
        load_bundle(bundle)

    assert str(refused.value) == f"manifest.json: a symbolic link; {NOT_REGULAR} lies in the folder"


def test_every_offender_is_counted_and_the_first_by_name_is_named(
    model_root: Path, tmp_path: Path
) -> None:
    bundle = linked_copy(model_root, tmp_path)
    add_unlisted_file("payload.py")(bundle)
    add_unlisted_file("tokenizer_config.json")(bundle)
    add_subdirectory_with_weights(bundle)

    with pytest.raises(UnexpectedBundleFile) as refused:
        verify_bundle(bundle)

    assert str(refused.value) == f"more: a directory; {NOT_REGULAR} lies in the folder (and 2 more)"


def test_a_signature_is_the_one_unlisted_file_a_bundle_may_hold(
    model_root: Path, tmp_path: Path
) -> None:
    bundle = linked_copy(model_root, tmp_path)
    # Not checked without trusted signers (test_signed_bundles.py checks real ones).
    (bundle / "manifest.json.sig").write_bytes(b"-----BEGIN SSH SIGNATURE-----\n")

    assert verify_bundle(bundle) == load_bundle(bundle).digest


def test_writing_a_manifest_refuses_what_no_bundle_may_hold(
    model_root: Path, tmp_path: Path
) -> None:
    bundle = linked_copy(model_root, tmp_path)
    add_subdirectory_with_weights(bundle)

    with pytest.raises(UnexpectedBundleFile) as refused:
        write_manifest(bundle)

    assert str(refused.value) == f"more: a directory; {NOT_REGULAR} lies in the folder"
