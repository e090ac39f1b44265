"""A team's own model, brought as docs/models.md says: its own tokenizer, vocabulary,
length and labels. Loaded, served, refused only for what it gets wrong, and checked
beforehand by `python -m capability.bundle verify --load` and listed by `manifest`."""

from __future__ import annotations

import hashlib
import json
import logging
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
    BundleConfigInvalid,
    BundleError,
    load_bundle,
    write_manifest,
)
from capability.bundle.__main__ import main as bundle_cli
from tests.conftest import StartCapability
from tests.status_details import error_reason, trailers_of
from tests.unit.capability.own_bundle import (
    LABELS,
    PANICS_ON_AAA,
    PANICS_ON_WARM_UP,
    split_first_by,
    write_own_bundle,
)

MODEL = "sentiment-byo"
STATIC = "topic-static"


def own_root(tmp_path: Path, *, vocab_size: int, max_seq_length: int = 64) -> Path:
    """A model root holding version 1 of the team's model."""
    root = tmp_path / "models"
    write_own_bundle(root / MODEL / "1", vocab_size=vocab_size, max_seq_length=max_seq_length)
    return root


async def classify(port: int, text: str) -> pb.ClassifyResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        response: pb.ClassifyResponse = await stub.Classify(
            pb.ClassifyRequest(text=text, model=MODEL)
        )
    return response


def edit_config(bundle: Path, edit: Callable[[dict[str, object]], object]) -> None:
    config = json.loads((bundle / "config.json").read_text(encoding="utf-8"))
    edit(config)
    (bundle / "config.json").write_text(json.dumps(config), encoding="utf-8")
    write_manifest(bundle)


# Vocabularies and lengths other than MiniLM's.


def test_a_vocabulary_of_under_1000_tokens_is_traced_and_classifies(tmp_path: Path) -> None:
    bundle = write_own_bundle(tmp_path / MODEL / "1", vocab_size=300)
    loaded = load_bundle(bundle, graph="torchscript")
    assert loaded.classifier.tokenizer.vocab_size <= 300
    texts = ["the movie was great", "terrible service " * 20]
    traced = loaded.classifier.classify(texts).probabilities
    assert torch.isfinite(traced).all()
    loaded.classifier.use_graph("eager")
    assert torch.equal(traced, loaded.classifier.classify(texts).probabilities)


async def test_a_server_warms_up_a_model_whose_vocabulary_is_under_1000_tokens(
    tmp_path: Path, start_capability: StartCapability
) -> None:
    # Eager, so that the worker's own warm-up texts are what this test pins.
    server = await start_capability(model_root=own_root(tmp_path, vocab_size=300), graph="eager")
    answer = await classify(server.port, "the food was great")
    assert {label.name for label in answer.labels} == set(LABELS)


async def test_a_server_warms_up_a_model_that_reads_fewer_than_64_tokens(
    tmp_path: Path, start_capability: StartCapability
) -> None:
    # Over 1,000 tokens, so that the vocabulary is not what is at stake; 16 tokens is
    # below every warm-up shape, the memory ledger's small one (32) included.
    root = own_root(tmp_path, vocab_size=1200, max_seq_length=16)
    server = await start_capability(model_root=root)
    answer = await classify(server.port, "the food was great " * 20)
    assert answer.model.version == "1"


def test_post_processor_ids_past_the_embedding_table_are_refused_naming_the_tokenizer(
    tmp_path: Path,
) -> None:
    bundle = write_own_bundle(tmp_path / MODEL / "1", special_ids=(5000, 5001))
    with pytest.raises(BundleError, match=r"^tokenizer\.json: token id 5001 .* does not fit"):
        load_bundle(bundle)


def test_a_model_must_read_more_tokens_than_its_special_ones(tmp_path: Path) -> None:
    # With 2, a request's max_length of 1 is raised to [CLS] + [SEP] + 1 token: over it.
    bundle = write_own_bundle(tmp_path / MODEL / "1", max_seq_length=2)
    with pytest.raises(BundleConfigInvalid, match=r"max_seq_length 2 must be at least 3"):
        load_bundle(bundle)


# Model names: the contract's one rule.


def test_verify_refuses_a_bundle_named_outside_the_model_name_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = write_own_bundle(tmp_path / "Sentiment-BYO" / "1", name="Sentiment-BYO")
    assert bundle_cli(["verify", "--quiet", str(bundle)]) == 1
    assert capsys.readouterr().err.startswith(
        "error: config.json: name 'Sentiment-BYO' is not a model name (lowercase letters"
    )


async def test_every_folder_the_server_skips_is_logged_with_the_reason(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    caplog: pytest.LogCaptureFixture,
) -> None:
    root = tmp_path / "models"
    shutil.copytree(model_root / STATIC / "1", root / STATIC / "1")
    write_own_bundle(root / "Sentiment-BYO" / "1", name="Sentiment-BYO")
    (root / "staged-model" / "2.tmp").mkdir(parents=True)
    caplog.set_level(logging.WARNING, logger="capability.lifecycle")
    server = await start_capability(model_root=root, default_model=STATIC)
    assert list(server.pool.models()) == [STATIC]
    lines = [
        (Path(vars(record)["folder"]).name, vars(record)["reason"])
        for record in caplog.records
        if record.getMessage() == "model folder skipped"
    ]
    skipped = dict(lines)
    # Once each: the start resolved the models to serve twice, logging each folder twice.
    assert sorted(name for name, _ in lines) == ["Sentiment-BYO", "staged-model"]
    assert skipped["Sentiment-BYO"].startswith("'Sentiment-BYO' is not a model name")
    assert skipped["staged-model"].startswith("no numbered version folder")


# verify --load: what a server would refuse.


def test_verify_load_passes_a_bundle_a_server_serves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = write_own_bundle(tmp_path / MODEL / "1")
    assert bundle_cli(["verify", "--quiet", "--load", str(bundle)]) == 0
    digest = hashlib.sha256((bundle / "manifest.json").read_bytes()).hexdigest()
    assert capsys.readouterr().out.strip() == digest
    # Named from inside the model folder: `1` has no parent folder name of its own, and
    # the bundle was refused as sitting under ''.
    monkeypatch.chdir(bundle.parent)
    assert bundle_cli(["verify", "--quiet", "--load", "1"]) == 0


def more_labels_than_the_head_scores(bundle: Path) -> None:
    def add_label(config: dict[str, object]) -> None:
        labels = config["labels"]
        assert isinstance(labels, list)
        labels.append({"name": "mixed", "description": "mixed"})

    edit_config(bundle, add_label)


def another_models_name(bundle: Path) -> None:
    edit_config(bundle, lambda c: c.update(name="other-model"))


def non_finite_head(bundle: Path) -> None:
    head = load_file(bundle / "head.safetensors")
    head["classifier.bias"][0] = float("nan")
    save_file(head, bundle / "head.safetensors")
    write_manifest(bundle)


def overflowing_embeddings(bundle: Path) -> None:
    """Finite weights whose computation overflows float32: refused only by the warm-up."""
    embeddings = load_file(bundle / "embeddings.safetensors")
    embeddings["embeddings.word_embeddings.weight"].fill_(3e38)
    save_file(embeddings, bundle / "embeddings.safetensors")
    write_manifest(bundle)


@pytest.mark.parametrize(
    ("damage", "server_says"),
    [
        (
            more_labels_than_the_head_scores,
            "head.safetensors: tensor classifier.weight has shape (3, 32), "
            "but config.json implies (4, 32)",
        ),
        (
            another_models_name,
            f"config.json: names model 'other-model', but the bundle sits under '{MODEL}'",
        ),
        (
            non_finite_head,
            "head.safetensors: tensor classifier.bias holds non-finite values (NaN or "
            "infinity) as float32",
        ),
        (overflowing_embeddings, "1: warm-up on cpu:0 produced non-finite scores"),
        (
            lambda bundle: split_first_by(bundle, PANICS_ON_WARM_UP),
            "tokenizer.json: fails on the warm-up texts: the tokenizer panicked: Onig: Regex "
            "search error: retry-limit-in-match over",
        ),
    ],
    ids=["labels", "name", "non-finite", "overflow", "tokenizer-panic"],
)
def test_verify_load_refuses_what_a_server_refuses_with_its_message(
    damage: Callable[[Path], None],
    server_says: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bundle = write_own_bundle(tmp_path / MODEL / "1")
    damage(bundle)
    assert bundle_cli(["verify", "--quiet", str(bundle)]) == 0  # every hash matches
    assert bundle_cli(["verify", "--quiet", "--load", str(bundle)]) == 1
    assert capsys.readouterr().err == f"error: {server_says}\n"


# The manifest command.


def test_manifest_command_lists_a_teams_bundle_which_then_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = write_own_bundle(tmp_path / MODEL / "1", with_manifest=False)
    assert bundle_cli(["manifest", str(bundle)]) == 0
    digest = hashlib.sha256((bundle / "manifest.json").read_bytes()).hexdigest()
    assert capsys.readouterr().out.strip() == digest
    assert load_bundle(bundle).digest == digest


def add_file(name: str) -> Callable[[Path], None]:
    def add(bundle: Path) -> None:
        (bundle / name).write_bytes(b"{}")

    return add


def copy_head_as_pt(bundle: Path) -> None:
    torch.save(load_file(bundle / "head.safetensors"), bundle / "head.pt")


def remove_layer(bundle: Path) -> None:
    (bundle / "layer_01.safetensors").unlink()


@pytest.mark.parametrize(
    ("offend", "refusal"),
    [
        (add_file("pytorch_model.bin"), "pytorch_model.bin: in the folder but not a weight file"),
        (add_file("tokenizer_config.json"), "tokenizer_config.json: not a file of a bundle"),
        (copy_head_as_pt, "head.pt: holds the same part as head.safetensors"),
        (remove_layer, "layer_01.safetensors: not found in "),
        (add_file("manifest.json.sig"), "manifest.json.sig: signs the manifest.json about"),
    ],
    ids=["foreign-weights", "foreign-file", "part-twice", "part-missing", "stale-signature"],
)
def test_manifest_command_refuses_a_folder_a_load_would_refuse(
    offend: Callable[[Path], None],
    refusal: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bundle = write_own_bundle(tmp_path / MODEL / "1", with_manifest=False)
    offend(bundle)
    assert bundle_cli(["manifest", str(bundle)]) == 1
    assert capsys.readouterr().err.startswith(f"error: {refusal}")
    assert not (bundle / "manifest.json").exists()


async def test_a_tokenizer_that_panics_answers_model_fault_with_ids(
    tmp_path: Path, start_capability: StartCapability
) -> None:
    """A bundle's pre-tokenizer regex that backtracks past Oniguruma's limit makes the
    Rust tokenizer panic: pyo3's PanicException derives from BaseException, not
    Exception, so it went past the handler that turns a tokenizer failure into a
    MODEL_FAULT."""
    root = own_root(tmp_path, vocab_size=300)
    bundle = root / MODEL / "1"
    split_first_by(bundle, PANICS_ON_AAA)
    server = await start_capability(model_root=root, graph="eager")
    assert (await classify(server.port, "the food was great")).labels
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await classify(server.port, "a" * 61 + "!")
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason(failed.value) == "MODEL_FAULT"
    assert trailers_of(failed.value)["x-request-id"]
