"""Build a classifier straight from a sentence-transformers MiniLM folder.

The bundle builder starts from this (capability.bundle.builder), and the parity tests
compare against it. Every refusal is a `ModelLoadError` naming the file at fault.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import Tensor

from capability.bundle.errors import ModelLoadError
from capability.bundle.format import MIN_SEQ_LENGTH
from capability.model import (
    DEFAULT_LABELS,
    EncoderConfig,
    LabelSpec,
    SentenceEncoder,
    TextClassifier,
    TextTokenizer,
    ZeroShotHead,
    embed_label_prototypes,
)
from classify_common.documents import DocumentRefused, load_json

# Checkpoint tensors the model deliberately does not use. Anything else the model lacks
# is an error, so a checkpoint of some other architecture cannot half-load.
_UNUSED_CHECKPOINT_KEYS = frozenset(
    {
        # BERT's [CLS] pooler (dense + tanh) for next-sentence prediction; sentence
        # embeddings here mean-pool the token vectors instead.
        "pooler.dense.weight",
        "pooler.dense.bias",
        # A saved arange(512); positions are computed on the fly, so the buffer is redundant.
        "embeddings.position_ids",
    }
)


def load_minilm_classifier(
    model_dir: Path,
    device: torch.device | str = "cpu",
    labels: Sequence[LabelSpec] = DEFAULT_LABELS,
    *,
    precision: str = "fp32",
) -> TextClassifier:
    """Build a ready classifier from a sentence-transformers MiniLM folder, on `device`.

    Reads `config.json`, `sentence_bert_config.json`, `1_Pooling/config.json`,
    `tokenizer.json` and `model.safetensors`; raises `ModelLoadError` naming the file
    when one is missing or does not describe a model this package implements.
    Prototypes are always embedded in float32; `precision` applies to texts afterwards.
    """
    model_dir = Path(model_dir)
    target = torch.device(device)
    if not labels:
        raise ValueError("a classifier needs at least one label")

    bert_config = _read_json_object(model_dir / "config.json")
    try:
        config = EncoderConfig.from_bert_config(bert_config)
    except ValueError as exc:
        raise ModelLoadError(f"config.json: {exc}") from exc

    max_seq_length, lowercase = _read_sentence_bert_config(
        model_dir / "sentence_bert_config.json", config.max_position_embeddings
    )
    _require_mean_pooling(model_dir / "1_Pooling" / "config.json", config.hidden_size)
    tokenizer = load_tokenizer(model_dir / "tokenizer.json", lowercase, config.vocab_size)

    with target:
        # Built directly on the target device so weights never take a detour through
        # host memory; the random initialisation is overwritten by the checkpoint below.
        encoder = SentenceEncoder(config)
    _load_weights(encoder, model_dir / "model.safetensors", target)
    encoder.eval()

    prototypes = embed_label_prototypes(encoder, tokenizer, labels, max_seq_length, target)
    return TextClassifier(
        tokenizer=tokenizer,
        encoder=encoder,
        head=ZeroShotHead(prototypes),
        labels=labels,
        max_seq_length=max_seq_length,
        device=target,
        precision=precision,
    )


def _read_sentence_bert_config(path: Path, max_positions: int) -> tuple[int, bool]:
    """The folder's `max_seq_length` (MIN_SEQ_LENGTH..`max_positions`) and `do_lower_case`."""
    st_config = _read_json_object(path)
    max_seq_length = st_config.get("max_seq_length")
    if (
        not isinstance(max_seq_length, int)
        or isinstance(max_seq_length, bool)
        or not MIN_SEQ_LENGTH <= max_seq_length <= max_positions
    ):
        raise ModelLoadError(
            f"{path.name}: max_seq_length must be an integer in "
            f"[{MIN_SEQ_LENGTH}, {max_positions}], got {max_seq_length!r}"
        )
    lowercase = st_config.get("do_lower_case", False)
    if not isinstance(lowercase, bool):
        raise ModelLoadError(f"{path.name}: do_lower_case must be true or false, got {lowercase!r}")
    return max_seq_length, lowercase


def _read_json_object(path: Path) -> dict[str, object]:
    try:
        parsed: object = load_json(path, source=path.name)
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{path.name}: not found in {path.parent}") from exc
    except OSError as exc:
        raise ModelLoadError(f"{path.name}: cannot be read: {exc}") from exc
    except DocumentRefused as exc:  # oversized, too deep, duplicate keys, not JSON
        raise ModelLoadError(str(exc)) from exc
    if not isinstance(parsed, dict):
        raise ModelLoadError(f"{path.name}: expected a JSON object, got {type(parsed).__name__}")
    return parsed


def _require_mean_pooling(path: Path, hidden_size: int) -> None:
    pooling = _read_json_object(path)
    modes = {key: value for key, value in pooling.items() if key.startswith("pooling_mode_")}
    enabled = sorted(key for key, value in modes.items() if value is True)
    if enabled != ["pooling_mode_mean_tokens"]:
        raise ModelLoadError(
            f"1_Pooling/{path.name}: only mean pooling is implemented, but the enabled "
            f"pooling modes are {enabled or 'none'}"
        )
    dimension = pooling.get("word_embedding_dimension", hidden_size)
    if dimension != hidden_size:
        raise ModelLoadError(
            f"1_Pooling/{path.name}: word_embedding_dimension {dimension!r} does not match "
            f"hidden_size {hidden_size} in config.json"
        )


def load_tokenizer(path: Path, lowercase: bool, vocab_size: int) -> TextTokenizer:
    """Load a `tokenizer.json` whose ids all fit a `vocab_size`-row embedding table."""
    if not path.is_file():
        raise ModelLoadError(f"{path.name}: not found in {path.parent}")
    return parse_tokenizer(path.read_bytes(), path.name, lowercase, vocab_size)


def saved_unknown_id(tokenizer: Tokenizer) -> int | None:
    """The id of the unknown piece as the tokenizer's model saves it (`unk_id`): a Unigram
    (SentencePiece) model names it nowhere else. None when it has none, or when the
    model names an `unk_token` (TextTokenizer reads that): saving the model writes its
    whole vocabulary out (3.5 ms a load for MiniLM's), for nothing."""
    if hasattr(tokenizer.model, "unk_token"):
        return None
    unknown_id = json.loads(tokenizer.model.__getstate__()).get("unk_id")
    return unknown_id if isinstance(unknown_id, int) and not isinstance(unknown_id, bool) else None


def parse_tokenizer(data: bytes, name: str, lowercase: bool, vocab_size: int) -> TextTokenizer:
    """A tokenizer from the bytes of a `tokenizer.json` (called `name` in errors) whose
    ids all fit a `vocab_size`-row embedding table."""
    try:
        rust = Tokenizer.from_buffer(data)
        tokenizer = TextTokenizer(rust, lowercase=lowercase, unknown_id=saved_unknown_id(rust))
    except Exception as exc:  # the Rust tokenizer raises bare Exception on a bad file
        raise ModelLoadError(f"{name}: cannot be loaded: {exc}") from exc
    if tokenizer.vocab_size > vocab_size:
        raise ModelLoadError(
            f"{name}: {tokenizer.vocab_size} tokens do not fit the "
            f"{vocab_size}-row embedding table in config.json"
        )
    # A post-processor template names its special tokens by id, so they can lie past
    # the vocabulary the count above checks; so can a vocabulary with gaps in its ids.
    if tokenizer.highest_id >= vocab_size:
        raise ModelLoadError(
            f"{name}: token id {tokenizer.highest_id} (a vocabulary or post-processor id) "
            f"does not fit the {vocab_size}-row embedding table in config.json"
        )
    return tokenizer


def _load_weights(encoder: SentenceEncoder, path: Path, device: torch.device) -> None:
    if not path.is_file():
        raise ModelLoadError(f"{path.name}: not found in {path.parent}")
    try:
        # safetensors holds raw tensors only, so loading cannot execute code (unlike pickle).
        checkpoint = load_file(path, device=str(device))
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise ModelLoadError(f"{path.name}: cannot be read: {exc}") from exc

    weights = {k: v for k, v in checkpoint.items() if k not in _UNUSED_CHECKPOINT_KEYS}
    _check_weights_fit(encoder.state_dict(), weights, path.name)
    encoder.load_state_dict(weights, strict=True)


def _check_weights_fit(
    expected: Mapping[str, Tensor], weights: Mapping[str, Tensor], file_name: str
) -> None:
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    if missing or unexpected:
        raise ModelLoadError(
            f"{file_name}: weights do not match the model; "
            f"missing {_abbreviate(missing)}, unexpected {_abbreviate(unexpected)}"
        )
    mismatched = [
        f"{key} {tuple(weights[key].shape)} != {tuple(expected[key].shape)}"
        for key in sorted(expected)
        if weights[key].shape != expected[key].shape
    ]
    if mismatched:
        raise ModelLoadError(f"{file_name}: weight shapes do not match config.json: {mismatched}")


def _abbreviate(keys: list[str], shown: int = 5) -> str:
    if len(keys) <= shown:
        return str(keys)
    return f"{keys[:shown]} and {len(keys) - shown} more"
