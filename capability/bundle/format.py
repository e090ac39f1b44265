"""The bundle format: file names, config.json's schema, and which file holds which weights.

A bundle is one directory per model version:

    config.json            what to build: architecture, dimensions, labels, head, precision
    tokenizer.json         the `tokenizers` file the model was trained with
    embeddings.safetensors token embedding tables (and, for BERT, positions + LayerNorm)
    layer_00.safetensors   one file per transformer layer (BERT only) ...
    head.safetensors       zero-shot `prototypes` (L, H), or linear `classifier.weight`
                           (L, H) and `classifier.bias` (L)
    manifest.json          size and SHA-256 of every other file

Weights are split per module so one part (a fine-tuned head, say) can be replaced
without rewriting the rest. Any weight part may instead be a `.pt` file of the same base
name, read with `torch.load(weights_only=True)`. Keys inside an encoder file are the
encoder's own state-dict keys (Hugging Face BERT names: `encoder.layer.3.output.dense.bias`),
so a file can be read on its own; keys inside the head file are the head's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from capability.bundle.errors import BundleConfigInvalid
from capability.model import (
    PRECISION_DTYPES,
    EncoderConfig,
    LabelSpec,
    StaticEncoderConfig,
)
from classify_common.model_names import MODEL_NAME_RULE, is_model_name

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "manifest.json"

# The formats a weight part may be stored in, in order of preference.
WEIGHT_SUFFIXES = (".safetensors", ".pt")
# Suffixes of files that may hold weights. A file with one of these that the manifest
# does not list is refused: it is either left over from another version or planted.
WEIGHT_LIKE_SUFFIXES = frozenset(
    {".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".npy", ".npz", ".onnx"}
)

BERT_ENCODER = "bert-encoder"
STATIC_EMBEDDING = "static-embedding"
ARCHITECTURES = (BERT_ENCODER, STATIC_EMBEDDING)

# "mean": average over every real token, [CLS] and [SEP] included (MiniLM's training).
# "mean_without_special": average over the words only (see StaticEncoderConfig).
POOLINGS: Mapping[str, tuple[str, ...]] = {
    BERT_ENCODER: ("mean",),
    STATIC_EMBEDDING: ("mean", "mean_without_special"),
}

ZERO_SHOT_HEAD = "zero-shot"
LINEAR_HEAD = "linear"

# The fewest tokens a model may read: [CLS], [SEP] and one token of text, the least a
# request's max_length is raised to (TextClassifier.token_budget).
MIN_SEQ_LENGTH = 3
# The most: the contract's largest token budget (ClassifyRequest.max_length), so no
# request reads more of a text. A static-embedding model has no position table to
# bound it, and its memory warm-up computes a batch at this length: 100,000,000
# asked 51 GB of one allocation and ended the start.
MAX_SEQ_LENGTH = 1024

# The largest each of config.json's dimensions may be. Each is far past any model of
# this kind (MiniLM: 30,522 x 384, 6 layers of 12 heads, 1,536 wide inside, 512
# positions, 2 token types; BERT-large: 1,024 wide, 24 layers) and small enough that
# no tensor's size overflows while the module is built: `vocab_size` 2**62 raised
# RuntimeError("Storage size calculation overflowed") from torch, which is no refusal
# naming config.json, and took a start down although version 1 was good.
MAX_DIMENSIONS: Mapping[str, int] = {
    # A tokenizer.json is at most 64 MiB (loader.MAX_TOKENIZER_BYTES), some 4 million
    # tokens at the 15 bytes a token ours takes.
    "vocab_size": 1 << 24,
    "hidden_size": 1 << 16,
    "num_layers": 256,
    "num_heads": 1 << 16,  # at most hidden_size, which it divides
    "intermediate_size": 1 << 18,
    "max_position_embeddings": 1 << 20,
    "type_vocab_size": 1 << 16,
}
# The most values one weight tensor may hold (2**31: 8 GiB in float32), so the largest
# table, `vocab_size` x `hidden_size`, is checked against one bound however its two
# dimensions share it out.
MAX_TENSOR_VALUES = 1 << 31
# LayerNorm's epsilon is added to each token's variance (about 1): BERT-family models
# use 1e-12 to 1e-5. Near the variance it flattens every token, and past it (1e300,
# Infinity) the encoder gave every text the same scores.
MAX_LAYER_NORM_EPS = 1e-3
# The zero-shot head's logit scale (ours: 40 and 65). At 1,000 a cosine gap of 0.01 is
# already e**10 to one; 1e300 overflowed float32 and scored every text NaN.
MAX_HEAD_SCALE = 1000.0


@dataclass(frozen=True)
class HeadSpec:
    """Which head ends the model; `scale` is the zero-shot head's logit scale."""

    type: str  # ZERO_SHOT_HEAD or LINEAR_HEAD
    scale: float | None = None


@dataclass(frozen=True)
class WeightPart:
    """One weight file's base name and the module whose tensors it holds."""

    name: str  # file name without suffix, e.g. "layer_03"
    owner: Literal["encoder", "head"]  # which module of the classifier it loads into
    prefix: str  # the submodule inside `owner`, as a state-dict key prefix ("" = all of it)


@dataclass(frozen=True)
class BundleConfig:
    """config.json, parsed and checked."""

    name: str
    architecture: str
    encoder: EncoderConfig | StaticEncoderConfig
    max_seq_length: int
    lowercase: bool
    pooling: str
    precision: str
    labels: tuple[LabelSpec, ...]
    head: HeadSpec

    @property
    def hidden_size(self) -> int:
        return self.encoder.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.encoder.vocab_size

    def weight_parts(self) -> tuple[WeightPart, ...]:
        """Every weight file this model needs, in load order."""
        parts = [WeightPart("embeddings", "encoder", "embeddings.")]
        if isinstance(self.encoder, EncoderConfig):
            parts += [
                WeightPart(f"layer_{index:02d}", "encoder", f"encoder.layer.{index}.")
                for index in range(self.encoder.num_layers)
            ]
        parts.append(WeightPart("head", "head", ""))
        return tuple(parts)

    def to_json(self) -> dict[str, object]:
        dimensions = dataclasses.asdict(self.encoder)
        # Stored as `pooling`, the one place that says how tokens are combined.
        dimensions.pop("include_special_tokens", None)
        head: dict[str, object] = {"type": self.head.type}
        if self.head.scale is not None:
            head["scale"] = self.head.scale
        return {
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "architecture": self.architecture,
            "dimensions": dimensions,
            "max_seq_length": self.max_seq_length,
            "lowercase": self.lowercase,
            "pooling": self.pooling,
            "precision": self.precision,
            "labels": [{"name": x.name, "description": x.description} for x in self.labels],
            "head": head,
        }

    @classmethod
    def from_json(cls, document: object) -> BundleConfig:
        """Parse config.json's content; raises BundleConfigInvalid naming the key at fault."""
        top = _Fields(document, "")
        version = top.integer("format_version")
        if version != FORMAT_VERSION:
            raise _invalid(f"format_version {version} is not supported; expected {FORMAT_VERSION}")
        name = top.string("name")
        # The contract's rule: a bundle is served under its model folder's name, and
        # requests, flags and routes.yaml can name no other.
        if not is_model_name(name):
            raise _invalid(f"name {name!r} is not a model name ({MODEL_NAME_RULE})")
        architecture = top.choice("architecture", ARCHITECTURES)
        pooling = top.choice("pooling", POOLINGS[architecture])
        encoder = _parse_dimensions(top.section("dimensions"), architecture, pooling)
        max_seq_length = top.integer("max_seq_length")
        limit, bound_by = MAX_SEQ_LENGTH, "the largest max_length a request may ask for"
        if isinstance(encoder, EncoderConfig) and encoder.max_position_embeddings < MAX_SEQ_LENGTH:
            limit, bound_by = encoder.max_position_embeddings, "max_position_embeddings"
        if not MIN_SEQ_LENGTH <= max_seq_length <= limit:
            least = f"at least {MIN_SEQ_LENGTH} ([CLS], [SEP] and one token of text)"
            raise _invalid(
                f"max_seq_length {max_seq_length} must be {least} and at most {limit} ({bound_by})"
            )
        lowercase = top.boolean("lowercase")
        precision = top.choice("precision", tuple(PRECISION_DTYPES))
        labels = _parse_labels(top.array("labels"))
        head = _parse_head(top.section("head"))
        top.refuse_leftovers()
        return cls(
            name=name,
            architecture=architecture,
            encoder=encoder,
            max_seq_length=max_seq_length,
            lowercase=lowercase,
            pooling=pooling,
            precision=precision,
            labels=labels,
            head=head,
        )


def _parse_dimensions(
    fields: _Fields, architecture: str, pooling: str
) -> EncoderConfig | StaticEncoderConfig:
    # Every value is read (and type-checked) before the config checks how they relate.
    if architecture == BERT_ENCODER:
        sizes = {
            key: fields.integer(key)
            for key in (
                "vocab_size",
                "hidden_size",
                "num_layers",
                "num_heads",
                "intermediate_size",
                "max_position_embeddings",
                "type_vocab_size",
                "pad_token_id",
            )
        }
        layer_norm_eps = fields.number("layer_norm_eps")
        fields.refuse_leftovers()
        _refuse_oversized(sizes)
        if not 0 < layer_norm_eps <= MAX_LAYER_NORM_EPS:
            raise _invalid(
                f"dimensions.layer_norm_eps must be positive and at most "
                f"{MAX_LAYER_NORM_EPS}, got {layer_norm_eps}"
            )
        try:
            return EncoderConfig(**sizes, layer_norm_eps=layer_norm_eps)
        except ValueError as exc:
            raise _invalid(f"dimensions: {exc}") from exc
    sizes = {key: fields.integer(key) for key in ("vocab_size", "hidden_size", "pad_token_id")}
    fields.refuse_leftovers()
    _refuse_oversized(sizes)
    try:
        return StaticEncoderConfig(**sizes, include_special_tokens=pooling == "mean")
    except ValueError as exc:
        raise _invalid(f"dimensions: {exc}") from exc


def _refuse_oversized(sizes: Mapping[str, int]) -> None:
    """Refuse a dimension past MAX_DIMENSIONS, then a table of more than
    MAX_TENSOR_VALUES values: each of the embedding tables and the feed-forward
    weights is one of `hidden_size`'s dimensions by another."""
    for key, value in sizes.items():
        most = MAX_DIMENSIONS.get(key)
        if most is not None and value > most:
            raise _invalid(f"dimensions.{key} {value} is over the limit of {most}")
    hidden = sizes["hidden_size"]
    for key in ("vocab_size", "max_position_embeddings", "type_vocab_size", "intermediate_size"):
        if key in sizes and sizes[key] * hidden > MAX_TENSOR_VALUES:
            raise _invalid(
                f"dimensions.{key} {sizes[key]} x hidden_size {hidden} is "
                f"{sizes[key] * hidden} values in one tensor, over the limit of "
                f"{MAX_TENSOR_VALUES}"
            )


def _parse_labels(items: list[object]) -> tuple[LabelSpec, ...]:
    if not items:
        raise _invalid("labels: a classifier needs at least one label")
    labels = []
    for index, item in enumerate(items):
        fields = _Fields(item, f"labels[{index}].")
        labels.append(LabelSpec(fields.string("name"), fields.string("description")))
        fields.refuse_leftovers()
    names = [label.name for label in labels]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise _invalid(f"labels: duplicate names {duplicates}")
    return tuple(labels)


def _parse_head(fields: _Fields) -> HeadSpec:
    kind = fields.choice("type", (ZERO_SHOT_HEAD, LINEAR_HEAD))
    if kind == ZERO_SHOT_HEAD:
        scale = fields.number("scale")
        if not 0 < scale <= MAX_HEAD_SCALE:
            raise _invalid(f"head.scale must be positive and at most {MAX_HEAD_SCALE}, got {scale}")
        fields.refuse_leftovers()
        return HeadSpec(ZERO_SHOT_HEAD, scale)
    fields.refuse_leftovers()
    return HeadSpec(LINEAR_HEAD)


def _invalid(message: str) -> BundleConfigInvalid:
    return BundleConfigInvalid(f"{CONFIG_FILE}: {message}")


class _Fields:
    """Reads a JSON object key by key, so that whatever is left at the end is unknown."""

    def __init__(self, document: object, path: str) -> None:
        if not isinstance(document, dict):
            where = path.rstrip(".") or "the document"
            raise _invalid(f"{where} must be a JSON object, got {type(document).__name__}")
        self._remaining: dict[str, object] = dict(document)
        self._path = path

    def _take(self, key: str) -> object:
        if key not in self._remaining:
            raise _invalid(f"missing key {self._path}{key!r}")
        return self._remaining.pop(key)

    def string(self, key: str) -> str:
        value = self._take(key)
        if not isinstance(value, str) or not value.strip():
            raise _invalid(f"{self._path}{key} must be a non-empty string, got {value!r}")
        return value

    def integer(self, key: str) -> int:
        value = self._take(key)
        # bool is an int subclass; `true` where a size belongs is a broken file, not 1.
        if not isinstance(value, int) or isinstance(value, bool):
            raise _invalid(f"{self._path}{key} must be an integer, got {value!r}")
        return value

    def number(self, key: str) -> float:
        value = self._take(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _invalid(f"{self._path}{key} must be a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an integer past float's range (10**400)
            number = math.inf
        # Python's JSON reader takes Infinity and NaN, and 1e999 reads as inf.
        if not math.isfinite(number):
            raise _invalid(f"{self._path}{key} must be a finite number, got {value!r}")
        return number

    def boolean(self, key: str) -> bool:
        value = self._take(key)
        if not isinstance(value, bool):
            raise _invalid(f"{self._path}{key} must be true or false, got {value!r}")
        return value

    def choice(self, key: str, allowed: tuple[str, ...]) -> str:
        value = self._take(key)
        if value not in allowed:
            raise _invalid(f"{self._path}{key} must be one of {list(allowed)}, got {value!r}")
        assert isinstance(value, str)
        return value

    def section(self, key: str) -> _Fields:
        return _Fields(self._take(key), f"{self._path}{key}.")

    def array(self, key: str) -> list[object]:
        value = self._take(key)
        if not isinstance(value, list):
            raise _invalid(f"{self._path}{key} must be a list, got {type(value).__name__}")
        return value

    def refuse_leftovers(self) -> None:
        if self._remaining:
            unknown = ", ".join(repr(f"{self._path}{key}") for key in sorted(self._remaining))
            raise _invalid(f"unknown key {unknown}")
