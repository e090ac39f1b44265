"""Classification heads: the linear head, and its equivalence with the zero-shot head."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias in PyTorch code

from capability.model import LinearHead, ZeroShotHead, linear_head_from_zero_shot


def unit_rows(rows: int, columns: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, columns, generator=generator), dim=1)


def test_linear_head_with_scaled_prototypes_reproduces_the_zero_shot_head() -> None:
    prototypes = unit_rows(4, 384, seed=0)
    embeddings = unit_rows(64, 384, seed=1)
    zero_shot = ZeroShotHead(prototypes, scale=40.0)
    linear = LinearHead(num_labels=4, hidden_size=384)
    with torch.no_grad():
        linear.classifier.weight.copy_(40.0 * prototypes)
        linear.classifier.bias.zero_()
    torch.testing.assert_close(linear(embeddings), zero_shot(embeddings), atol=1e-6, rtol=0)


def test_conversion_writes_scale_times_prototypes_and_zero_bias() -> None:
    zero_shot = ZeroShotHead(unit_rows(3, 16, seed=2), scale=65.0)
    linear = linear_head_from_zero_shot(zero_shot)
    torch.testing.assert_close(linear.classifier.weight, 65.0 * zero_shot.prototypes)
    assert bool((linear.classifier.bias == 0).all())
    embeddings = unit_rows(10, 16, seed=3)
    torch.testing.assert_close(linear(embeddings), zero_shot(embeddings), atol=1e-6, rtol=0)


def test_linear_head_adds_its_bias_before_the_softmax() -> None:
    linear = LinearHead(num_labels=2, hidden_size=3)
    with torch.no_grad():
        linear.classifier.weight.zero_()
        linear.classifier.bias.copy_(torch.tensor([0.0, math.log(3.0)]))
    torch.testing.assert_close(linear(torch.ones(1, 3)), torch.tensor([[0.25, 0.75]]))


def test_linear_head_carries_a_bert_sequence_classifiers_parameter_names() -> None:
    # So a fine-tuned classifier's head drops into head.safetensors without renaming.
    shapes = {key: tuple(t.shape) for key, t in LinearHead(4, 384).state_dict().items()}
    assert shapes == {"classifier.weight": (4, 384), "classifier.bias": (4,)}
