"""The static word-vector encoder on tiny hand-made tables, where the answer is known."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias in PyTorch code

from capability.model import StaticEmbeddingEncoder, StaticEncoderConfig, ZeroShotHead

CLS, SEP, PAD = 1, 2, 0


def encoder_with_table(*, include_special_tokens: bool = False) -> StaticEmbeddingEncoder:
    config = StaticEncoderConfig(
        vocab_size=8, hidden_size=3, pad_token_id=PAD, include_special_tokens=include_special_tokens
    )
    encoder = StaticEmbeddingEncoder(config)
    with torch.no_grad():
        encoder.embeddings.word_embeddings.weight.copy_(
            torch.tensor(
                [
                    [0.0, 0.0, 0.0],  # [PAD]
                    [5.0, 5.0, 5.0],  # [CLS]
                    [-5.0, 5.0, -5.0],  # [SEP]
                    [1.0, 0.0, 0.0],
                    [0.0, 1.0, 0.0],
                    [0.0, 0.0, 1.0],
                    [1.0, 1.0, 0.0],
                    [3.0, 0.0, 4.0],
                ]
            )
        )
    return encoder.eval()


def embed(encoder: StaticEmbeddingEncoder, rows: list[list[int]]) -> torch.Tensor:
    width = max(len(row) for row in rows)
    ids = torch.tensor([row + [PAD] * (width - len(row)) for row in rows])  # (B, T)
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])  # (B, T)
    with torch.inference_mode():
        embeddings: torch.Tensor = encoder(ids, mask)  # (B, H)
    return embeddings


def test_embedding_is_the_normalised_mean_of_the_word_vectors() -> None:
    embedding = embed(encoder_with_table(), [[CLS, 3, 4, SEP]])
    torch.testing.assert_close(embedding, F.normalize(torch.tensor([[0.5, 0.5, 0.0]]), dim=1))


def test_special_tokens_join_the_mean_only_when_asked() -> None:
    embedding = embed(encoder_with_table(include_special_tokens=True), [[CLS, 3, 4, SEP]])
    expected = torch.tensor([[5.0 - 5.0 + 1.0, 5.0 + 5.0 + 1.0, 5.0 - 5.0]]) / 4
    torch.testing.assert_close(embedding, F.normalize(expected, dim=1))


def test_padding_does_not_change_the_embedding() -> None:
    encoder = encoder_with_table()
    rows = [[CLS, 7, SEP], [CLS, 3, 4, 5, 6, 7, SEP], [CLS, SEP]]
    batched = embed(encoder, rows)
    one_by_one = torch.cat([embed(encoder, [row]) for row in rows])
    torch.testing.assert_close(batched, one_by_one, atol=0, rtol=0)


def test_text_without_words_scores_every_label_the_same() -> None:
    embedding = embed(encoder_with_table(), [[CLS, SEP]])
    assert bool((embedding == 0).all())
    head = ZeroShotHead(torch.eye(3), scale=65.0)
    torch.testing.assert_close(head(embedding), torch.full((1, 3), 1 / 3))


def test_bf16_table_still_returns_float32_embeddings() -> None:
    encoder = encoder_with_table().to(torch.bfloat16)
    embedding = embed(encoder, [[CLS, 3, 7, SEP]])
    assert embedding.dtype == torch.float32
    torch.testing.assert_close(embedding, F.normalize(torch.tensor([[2.0, 0.0, 2.0]]), dim=1))


def test_config_refuses_a_pad_id_outside_the_table() -> None:
    with pytest.raises(ValueError, match="pad_token_id"):
        StaticEncoderConfig(vocab_size=8, hidden_size=3, pad_token_id=8)
