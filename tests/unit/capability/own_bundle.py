"""A team's own bundle, built the way docs/models.md ('Bring your own model') says:
a small BERT encoder with random weights, a WordPiece tokenizer trained here, a
linear head, config.json written by hand, and manifest.json by write_manifest.

Small on purpose (a few hundred tokens, 32 wide, 2 layers): it loads in well under a
second, and its vocabulary, length and names are whatever a test asks for, unlike
the MiniLM bundles' fixed 30,522 tokens and 256 positions.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import (
    Regex,
    Tokenizer,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from capability.bundle import write_manifest

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
LABELS = ("positive", "negative", "neutral")
HIDDEN_SIZE = 32
NUM_LAYERS = 2
NUM_HEADS = 2
MAX_POSITIONS = 128
_CORPUS = [
    "the movie was great and i loved it",
    "terrible service, never again",
    "it was fine, nothing special",
    "the food was cold and bland",
] * 20


def train_tokenizer(vocab_size: int, special_ids: tuple[int, int] | None = None) -> Tokenizer:
    """A lowercasing WordPiece tokenizer of at most `vocab_size` tokens, wrapping each
    text in [CLS] ... [SEP]; `special_ids` gives the template other ids for the two."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS))
    # Made-up words let the vocabulary grow to the size asked for.
    filler = " ".join(f"w{index}" for index in range(vocab_size))
    tokenizer.train_from_iterator([*_CORPUS, filler], trainer)
    cls_id, sep_id = special_ids or (tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    return tokenizer


def encoder_tensors(vocab_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """Random weights under Hugging Face BERT names, by weight file (without suffix)."""
    hidden, inner = HIDDEN_SIZE, 4 * HIDDEN_SIZE
    files = {
        "embeddings": {
            "embeddings.word_embeddings.weight": torch.randn(vocab_size, hidden) * 0.02,
            "embeddings.position_embeddings.weight": torch.randn(MAX_POSITIONS, hidden) * 0.02,
            "embeddings.token_type_embeddings.weight": torch.randn(2, hidden) * 0.02,
            "embeddings.LayerNorm.weight": torch.ones(hidden),
            "embeddings.LayerNorm.bias": torch.zeros(hidden),
        }
    }
    shapes = {
        "attention.self.query": (hidden, hidden),
        "attention.self.key": (hidden, hidden),
        "attention.self.value": (hidden, hidden),
        "attention.output.dense": (hidden, hidden),
        "intermediate.dense": (inner, hidden),
        "output.dense": (hidden, inner),
    }
    for index in range(NUM_LAYERS):
        prefix = f"encoder.layer.{index}."
        layer: dict[str, torch.Tensor] = {}
        for module, (rows, columns) in shapes.items():
            layer[f"{prefix}{module}.weight"] = torch.randn(rows, columns) * 0.02
            layer[f"{prefix}{module}.bias"] = torch.zeros(rows)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            layer[f"{prefix}{norm}.weight"] = torch.ones(hidden)
            layer[f"{prefix}{norm}.bias"] = torch.zeros(hidden)
        files[f"layer_{index:02d}"] = layer
    return files


def write_own_bundle(
    out: Path,
    *,
    vocab_size: int = 300,
    max_seq_length: int = 64,
    name: str = "sentiment-byo",
    labels: Sequence[str] = LABELS,
    special_ids: tuple[int, int] | None = None,
    with_manifest: bool = True,
) -> Path:
    """Write a bundle to `out` (made here); `vocab_size` is the most tokens the
    tokenizer may learn, and config.json records what it did learn. `labels` go in
    config.json only: the head always scores LABELS, so other labels misfit it."""
    torch.manual_seed(0)
    out.mkdir(parents=True)
    tokenizer = train_tokenizer(vocab_size, special_ids)
    tokenizer.save(str(out / "tokenizer.json"))
    learned = tokenizer.get_vocab_size(with_added_tokens=True)
    for part, tensors in encoder_tensors(learned).items():
        save_file(tensors, out / f"{part}.safetensors")
    head = {
        "classifier.weight": torch.randn(len(LABELS), HIDDEN_SIZE),
        "classifier.bias": torch.zeros(len(LABELS)),
    }
    save_file(head, out / "head.safetensors")
    config = {
        "format_version": 1,
        "name": name,
        "architecture": "bert-encoder",
        "dimensions": {
            "vocab_size": learned,
            "hidden_size": HIDDEN_SIZE,
            "num_layers": NUM_LAYERS,
            "num_heads": NUM_HEADS,
            "intermediate_size": 4 * HIDDEN_SIZE,
            "max_position_embeddings": MAX_POSITIONS,
            "type_vocab_size": 2,
            "layer_norm_eps": 1e-12,
            "pad_token_id": tokenizer.token_to_id("[PAD]"),
        },
        "max_seq_length": max_seq_length,
        "lowercase": True,
        "pooling": "mean",
        "precision": "fp32",
        "labels": [{"name": label, "description": f"a {label} review"} for label in labels],
        "head": {"type": "linear"},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if with_manifest:
        write_manifest(out)
    return out


# Pre-tokenizer regexes that backtrack past Oniguruma's limit, making the Rust tokenizer
# panic (pyo3 raises a PanicException, a BaseException): on a run of "a" then "!"
# only, and on every text of a few words (the warm-up's; not on the single word a
# tokenizer is checked with at load).
PANICS_ON_AAA = "(a|aa)+$"
PANICS_ON_WARM_UP = "(.|..)+$x"


def split_first_by(bundle: Path, pattern: str) -> None:
    """Put a Split on `pattern` before the bundle's BERT pre-tokenizer, and list the
    changed tokenizer.json in a new manifest."""
    tokenizer = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.BertPreTokenizer(),
        ]
    )
    tokenizer.save(str(bundle / "tokenizer.json"))
    write_manifest(bundle)
