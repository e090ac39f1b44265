"""Text -> padded token-id batches, the way the sentence-transformers reference does it."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

# Characters of text one token can stand for, at most, in text meant for reading. A text
# is cut to `max_length` times this before it is tokenized, so a 100,000-character
# request costs what a 4,096-character one does (256 tokens here), not 25x more, and
# the tokens kept are the same. Measured with the MiniLM vocabulary: English prose
# and headlines 3.5-5.7 characters a token, Python source 3.7, URLs 2.7, hex 1.9, CJK
# 1; 16 leaves room for about three times the sparsest. Only text built otherwise
# (words over 100 characters, each one [UNK]; long runs of spaces) can hold fewer
# tokens than the budget within the cut, and then the model reads fewer of them. The
# cut starts at the text's first character that is not blank (text_window).
MAX_CHARS_PER_TOKEN = 16
# The word stand-in texts repeat (TextTokenizer.stand_in): any word will do, as long as
# it is the tokenizer's own id and not one fixed for MiniLM's 30,522-token vocabulary.
STAND_IN_WORD = "text"
# SentencePiece's mark of a word's start (Metaspace), a piece of its own before a
# character the vocabulary lacks.
WORD_START = "\u2581"


# What a tokenizer call may end with that is no failure of the tokenizer.
_NOT_A_FAILURE = (KeyboardInterrupt, SystemExit, GeneratorExit)


def _blank_characters() -> str:
    """The characters the contract's `text.not_blank` rule counts as blank (Unicode's
    separators, Z; control and format characters, Cc and Cf), as a regex class body.

    Python's `re` has no `\\p{...}`, so they are read from unicodedata: 247 code points,
    all within planes 0, 1 and 14 (plane 15 and 16 are private use), which take 50 ms
    to scan, against 300 for every plane."""
    planes = (*range(0x20000), *range(0xE0000, 0xE1000))
    blank = (chr(c) for c in planes if unicodedata.category(chr(c)) in _BLANK_CATEGORIES)
    return "".join(re.escape(char) for char in blank)


_BLANK_CATEGORIES = frozenset({"Zs", "Zl", "Zp", "Cc", "Cf"})
# What a cut text's window skips at its start: whitespace, and what the tokenizer drops
# unread (a zero-width space, a byte-order mark, NUL), which the contract counts as
# blank too. Skipping whitespace alone, a long text opening with 4,100 zero-width
# spaces was cut to nothing the model reads, and refused as unreadable.
_LEADING_BLANKS = re.compile(rf"[\s{_blank_characters()}]*")


def text_window(text: str, max_chars: int) -> tuple[str, bool]:
    """The part of `text` the tokenizer is given, at most `max_chars` characters, and
    whether any of the text was left out.

    A text longer than that is cut from its first character that is not blank (not
    whitespace, nor a character the contract's `text.not_blank` counts as blank):
    one opening with a page of blank lines or spaces (text taken from a PDF or an HTML
    page) was cut to nothing else, and refused as unreadable (UNREADABLE_TEXT) however
    many words followed. A text within it is given whole, as it is."""
    if len(text) <= max_chars:
        return text, False
    leading = _LEADING_BLANKS.match(text)  # always matches, if only nothing
    start = leading.end() if leading is not None else 0
    return text[start : start + max_chars], len(text) - start > max_chars


class TokenizerFailed(RuntimeError):
    """The Rust tokenizer panicked (a bundle's pre-tokenizer regex over Oniguruma's
    backtracking limit, say). pyo3 raises a panic as PanicException, which derives from
    BaseException: past every `except Exception`, a panic at load or warm-up ended the
    model watcher's task."""


@contextmanager
def panics_as_failures() -> Iterator[None]:
    """Raise a panic of the Rust tokenizer within as TokenizerFailed."""
    try:
        yield
    except (*_NOT_A_FAILURE, Exception):
        raise
    except BaseException as exc:
        raise TokenizerFailed(f"the tokenizer panicked: {exc}") from exc


@dataclass(frozen=True)
class EncodedText:
    """One text's token ids after truncation, before padding.

    The serving path tokenizes each request on arrival (so its length is known when
    batches are grouped by length) and pads a group only when the batch is formed.
    """

    ids: tuple[int, ...]  # [CLS] ... [SEP], at most the budget long
    truncated: bool  # whether the text lost tokens to the budget
    # Whether any token between [CLS] and [SEP] stands for text the vocabulary knows
    # (not [UNK], nor a SentencePiece word-start mark alone): a text of emoji, or only
    # of characters the normalizer drops, gives the model nothing to read, and its
    # answer would be the model's bias, with confidence.
    readable: bool = True

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class TokenBatch:
    """A right-padded batch of token ids ready for `SentenceEncoder`."""

    input_ids: torch.Tensor  # (B, T) int64, [PAD] after each text's last real token
    attention_mask: torch.Tensor  # (B, T) int64, 1 for real tokens, 0 for padding
    lengths: tuple[int, ...]  # real tokens per text after truncation, [CLS]/[SEP] included
    truncated: tuple[bool, ...]  # whether the text lost tokens to the budget

    @property
    def padding_ratio(self) -> float:
        """Share of the batch's positions that are padding: compute spent on nothing."""
        positions = self.input_ids.numel()
        if positions == 0:
            return 0.0
        return 1.0 - sum(self.lengths) / positions


class TextTokenizer:
    """BERT WordPiece tokenization, truncated to a per-call budget, padded to the batch's longest.

    The shipped `tokenizer.json` carries its own settings (truncate and pad everything to
    128 tokens), which disagree with the reference pipeline (truncate at the model's
    `max_seq_length`, pad to the longest text). Both are switched off at construction and
    done here instead, per call, without mutating the shared Rust tokenizer, so one
    instance can serve concurrent callers with different budgets.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        lowercase: bool,
        pad_token: str = "[PAD]",
        unknown_id: int | None = None,
    ) -> None:
        """`unknown_id`: the id of the piece for text the vocabulary lacks, where the
        tokenizer's model names it only in its saved form (a Unigram model's `unk_id`,
        which the bundle loader reads from tokenizer.json)."""
        tokenizer.no_truncation()
        tokenizer.no_padding()
        pad_id = tokenizer.token_to_id(pad_token)
        if pad_id is None:
            raise ValueError(f"the vocabulary has no {pad_token!r} token")
        # Truncation below keeps the first and the last special token of each encoding,
        # which is only right for a one-before, one-after template like BERT's [CLS] A [SEP].
        with panics_as_failures():
            empty = tokenizer.encode("")
        if empty.special_tokens_mask != [1, 1]:
            raise ValueError(
                "the post-processor must wrap a text in exactly one leading and one trailing "
                f"special token; it turns an empty text into {empty.tokens}"
            )
        self._tokenizer = tokenizer
        self._lowercase = lowercase
        self.pad_token_id: int = pad_id
        self.special_tokens_per_text = 2
        # The ids the post-processor wraps every text in ([CLS] and [SEP] for BERT).
        # A template names them by id, so they may lie outside the vocabulary.
        self.opening_id, self.closing_id = empty.ids
        # Any id of the tokenizer's own that stands for text, for stand-in texts: the
        # first word of STAND_IN_WORD (whatever [UNK] or pieces it becomes), or [PAD]
        # for a tokenizer that makes no tokens of it.
        with panics_as_failures():
            words = tokenizer.encode(STAND_IN_WORD, add_special_tokens=False).ids
        self._stand_in_id: int = words[0] if words else pad_id
        # The ids that stand for no text the model can read (see _unreadable_ids); a
        # text made of them alone is unreadable.
        self.unreadable_ids: frozenset[int] = _unreadable_ids(tokenizer, unknown_id)

    @property
    def lowercase(self) -> bool:
        """Whether texts are lowercased before tokenizing (sentence-transformers' do_lower_case)."""
        return self._lowercase

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def highest_id(self) -> int:
        """The highest token id this tokenizer can emit: an embedding table needs one
        more row than this."""
        vocabulary = self._tokenizer.get_vocab(with_added_tokens=True).values()
        return max(self.opening_id, self.closing_id, self.pad_token_id, *vocabulary)

    def stand_in(self, tokens: int) -> EncodedText:
        """A text of exactly `tokens` ids, opening and closing tokens included, made of
        this tokenizer's own ids: for tracing and warming up a model of any vocabulary."""
        if tokens < self.special_tokens_per_text:
            raise ValueError(
                f"a stand-in text of {tokens} tokens leaves no room for the "
                f"{self.special_tokens_per_text} special tokens"
            )
        words = (self._stand_in_id,) * (tokens - self.special_tokens_per_text)
        return EncodedText(ids=(self.opening_id, *words, self.closing_id), truncated=False)

    def encode(self, texts: Sequence[str], max_length: int) -> TokenBatch:
        """Tokenize `texts`, cutting each to `max_length` tokens including [CLS] and [SEP]."""
        return self.collate(self.encode_each(texts, max_length))

    def encode_each(self, texts: Sequence[str], max_length: int) -> list[EncodedText]:
        """Tokenize and truncate each text on its own, without padding.

        Each text is first cut to `max_length * MAX_CHARS_PER_TOKEN` characters, more
        than its tokens within the budget can span, so the tokenizer's work is bounded
        by the budget rather than by the text's length (text_window).
        """
        if max_length < self.special_tokens_per_text:
            raise ValueError(
                f"max_length {max_length} leaves no room for the "
                f"{self.special_tokens_per_text} special tokens"
            )
        max_chars = max_length * MAX_CHARS_PER_TOKEN
        # The reference lowercases before tokenizing when do_lower_case is set; this
        # tokenizer's normalizer lowercases too, so for MiniLM the flag changes nothing.
        windows = [text_window(text, max_chars) for text in texts]
        prepared = [window.lower() if self._lowercase else window for window, _ in windows]
        # The fast variant skips the character offsets of each token, which nothing
        # here reads: about a sixth less time for a batch of short texts.
        try:  # inline, not panics_as_failures(): this is every request's path
            encodings = self._tokenizer.encode_batch_fast(prepared, add_special_tokens=True)
        except (*_NOT_A_FAILURE, Exception):
            raise
        except BaseException as exc:
            raise TokenizerFailed(f"the tokenizer panicked: {exc}") from exc

        encoded: list[EncodedText] = []
        unreadable = self.unreadable_ids
        for (_, cut), encoding in zip(windows, encodings, strict=True):
            ids = encoding.ids
            too_long = len(ids) > max_length
            if too_long:
                # Drop tokens from the end of the text but keep the closing [SEP], which is
                # what the reference's longest-first truncation yields for a single text.
                ids = [*ids[: max_length - 1], ids[-1]]
            # A text cut short lost tokens too, even in the rare case that what is left
            # fits the budget.
            truncated = too_long or cut
            # What the model reads: the tokens within the budget, less [CLS] and [SEP].
            # Stops at the first known token, the first one in almost every text.
            readable = any(ids[i] not in unreadable for i in range(1, len(ids) - 1))
            encoded.append(EncodedText(ids=tuple(ids), truncated=truncated, readable=readable))
        return encoded

    def collate(self, encoded: Sequence[EncodedText]) -> TokenBatch:
        """Right-pad encoded texts to the longest of them."""
        rows = [text.ids for text in encoded]
        lengths = tuple(len(ids) for ids in rows)
        if not rows:
            nothing = torch.zeros((0, 0), dtype=torch.int64)  # (0, 0)
            return TokenBatch(input_ids=nothing, attention_mask=nothing, lengths=(), truncated=())
        width = max(lengths)
        # Each tensor is built in one call from padded Python rows. This runs on the
        # device thread between forwards: a per-row copy, or tensor ops to make the
        # mask, would each give up the GIL and wait to win it back from the serving loop.
        padding = (self.pad_token_id,)
        input_ids = torch.tensor(
            [ids + padding * (width - len(ids)) for ids in rows], dtype=torch.int64
        )  # (B, T)
        attention_mask = torch.tensor(
            [[1] * length + [0] * (width - length) for length in lengths],
            dtype=torch.int64,
        )  # (B, T)
        return TokenBatch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            lengths=lengths,
            truncated=tuple(text.truncated for text in encoded),
        )


def _unreadable_ids(tokenizer: Tokenizer, unknown_id: int | None) -> frozenset[int]:
    """The ids of pieces that stand for no text the model knows: the piece for text the
    vocabulary lacks (WordPiece's and BPE's `unk_token`, else `unknown_id`: a Unigram
    model's `unk_id`, which only the model's saved form names), and pieces of no text at all
    (SentencePiece's word-start mark on its own, which comes before every character
    the vocabulary lacks: without it, a SentencePiece text of emoji read as known
    pieces). Special tokens stay out: the post-processor's sit outside what is judged.
    A model without an unknown piece (byte-level BPE) knows every text."""
    ids: set[int] = set()
    unknown = getattr(tokenizer.model, "unk_token", None)
    if unknown:
        unknown_id = tokenizer.token_to_id(unknown)
    if unknown_id is not None:
        ids.add(unknown_id)
    for piece, piece_id in tokenizer.get_vocab(with_added_tokens=False).items():
        if not piece.replace(WORD_START, "").strip():
            ids.add(piece_id)
    return frozenset(ids)
