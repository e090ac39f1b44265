"""Results the model already computed, answered again without the queue or the device.

A repeated text (the same headline from many clients, a retry, a polling client)
is looked up after tokenizing and before admission: a hit is answered on the event
loop, never queued, batched or computed. Entries are keyed by model, the serving
bundle's digest (the SHA-256 of its manifest.json, which lists every file's SHA-256)
and the text as the model reads it: its token ids, after the tokenizer's own
normalisation and the truncation to the call's `max_length`.

Why the digest and not the version: a version is a directory's name, and a bundle
rebuilt under the same name (new weights, a new head) is another model; its digest
differs, so a result of the one is never stored for or found by the other, even one
computed by the old bundle and finished after the swap. Two bundles with one digest
hold byte-identical files and compute identical scores.

Why token ids stand for "normalised text and max_length": the ids are exactly what
the model is given (the attention mask follows from their count), so two texts with
the same ids get the same scores, whatever their spelling before the tokenizer's
normalisation and whatever `max_length` cut them to those ids. A separate text
normaliser could only be coarser than the tokenizer's own (folding texts the model
tells apart) or finer (missing texts it cannot); and a `max_length` in the key would
only split entries whose scores are equal. The ids are the tightest key that is
still exact. The scores are the same whichever text filled the entry; what the
answer says about the text itself (token count, truncated) is the caller's.

Bounded by entries and by (estimated) bytes, least recently used out first. Only
the serving bundle's results are stored or found: when a model's bundle changes
every entry of the old one is dropped, and the texts hit most often are returned
to be computed again on the new one (the pool does, at batch priority), so a
swap does not empty the cache of its most frequent queries.

Scoped: every entry belongs to one cache scope, and a lookup finds only its own
scope's entries (and the shared scope's, below). The orchestrator sends each call's
scope, derived from the caller's tenant (classify_common.context.cache_scope_of):
in a Classify call's CACHE_SCOPE_HEADER, and per item of a ClassifyBatch call in its
ItemContext.cache_scope. A result one tenant computed therefore never answers
another tenant (`cached: true`, and a hit's far shorter time, would tell it that
the text had been sent). The scope is trusted because a server with an internal
token answers no caller without it; without a token (development) it is whatever
the call says, and a call without one (not through an orchestrator) is the
unscoped "" scope. The bounds stay global: the scopes share one LRU.

After a swap, a carried text is computed again into the scope it was hit in, so a
tenant (or the single tenant, or `anonymous` without auth) finds its most hit
texts again. A model's warm_texts file belongs to no tenant: its texts fill the
shared scope (SHARED_SCOPE, which no call can name), looked up by every scope after
its own. They are the operator's texts, not any caller's, so a hit on them tells a
caller only what the operator listed.
"""

from __future__ import annotations

import re
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from capability.bundle.errors import ModelLoadError
from capability.metrics import CACHE_HIT, CACHE_MISS, CapabilityMetrics
from capability.model import EncodedText

# Bytes an entry costs beyond its text, ids and scores: the key tuple, the entry
# object and the OrderedDict's node (measured with sys.getsizeof, rounded up).
ENTRY_OVERHEAD_BYTES = 400
# Bytes per token id and per score held (a Python int or float in a tuple).
BYTES_PER_NUMBER = 32

# Defaults of --result-cache-entries, --result-cache-bytes, --result-cache-warm.
DEFAULT_ENTRIES = 10_000
DEFAULT_BYTES = 64 * 2**20
DEFAULT_WARM = 100

# A model's warm_texts file (--model-config): at most this many texts, each at most
# the contract's 100,000 characters, from the whole lines in its first
# WARM_TEXTS_MAX_BYTES; the rest of the file is not read.
WARM_TEXTS_LIMIT = 10_000
WARM_TEXT_CHARS = 100_000
WARM_TEXTS_MAX_BYTES = 16 * 2**20
# Where a warm_texts file's lines end: \r\n, \r or \n (no byte of a UTF-8 character
# but these is one of them).
_LINE_BREAK = re.compile(rb"\r\n|\r|\n")

# The scope of the warm_texts files' entries, read by every scope: None, which no
# call can send (a scope on the wire is a string).
SHARED_SCOPE = None
# A scope: a string sent with the call ("" when none was), or SHARED_SCOPE.
Scope = str | None

Key = tuple[str, str, Scope, tuple[int, ...]]  # (model, bundle digest, scope, token ids)


@dataclass(slots=True)
class _Entry:
    probabilities: tuple[float, ...]
    # The first text that filled the entry, and its max_length: what a new version
    # computes again when the entry is among the most hit.
    text: str
    max_length: int | None
    size_bytes: int
    # The scope it is stored under: what a new version fills again.
    scope: Scope
    hits: int = 0


@dataclass(frozen=True, slots=True)
class WarmText:
    """A text to compute on a model's new version, to fill the cache before it is asked,
    and the scope it fills (a warm_texts file's: the shared scope)."""

    text: str
    max_length: int | None
    scope: Scope = SHARED_SCOPE


class ResultCache:
    """An LRU of label probabilities per (model, bundle digest, scope, token ids); see
    the module docstring. `max_entries` 0 turns it off (every lookup misses, nothing is
    stored)."""

    def __init__(
        self, metrics: CapabilityMetrics, *, max_entries: int, max_bytes: int, warm: int
    ) -> None:
        self._metrics = metrics
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._warm = warm
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()
        self.size_bytes = 0
        # The digest of each model's serving bundle: only its results are stored and found.
        self._serving: dict[str, str] = {}

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(
        self, model: str, digest: str, scope: str, encoded: EncodedText
    ) -> tuple[float, ...] | None:
        """The stored scores of this text on the bundle with this digest, in `scope` or
        else the shared scope, counted as a hit or a miss."""
        if not self.enabled:
            return None
        key: Key = (model, digest, scope, encoded.ids)
        entry = self._entries.get(key)
        if entry is None:
            key = (model, digest, SHARED_SCOPE, encoded.ids)
            entry = self._entries.get(key)
        if entry is None or self._serving.get(model) != digest:
            self._metrics.cache_requests.labels(model, CACHE_MISS).inc()
            return None
        self._entries.move_to_end(key)
        entry.hits += 1
        self._metrics.cache_requests.labels(model, CACHE_HIT).inc()
        return entry.probabilities

    def store(
        self,
        model: str,
        digest: str,
        scope: Scope,
        encoded: EncodedText,
        text: str,
        max_length: int | None,
        probabilities: tuple[float, ...],
    ) -> None:
        """Remember, in `scope`, the scores of a text the serving bundle computed; a
        result of a bundle no longer serving (finished after a swap) is not kept."""
        if not self.enabled or self._serving.get(model) != digest:
            return
        key: Key = (model, digest, scope, encoded.ids)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        # sys.getsizeof, not the UTF-8 length: CPython keeps a string at 1, 2 or 4
        # bytes a character, as its widest needs, so one emoji makes a text of 100,000
        # characters cost 400 KB (a caller chose it).
        size = (
            ENTRY_OVERHEAD_BYTES
            + sys.getsizeof(text)
            + sys.getsizeof(scope or "")
            + BYTES_PER_NUMBER * (len(encoded.ids) + len(probabilities))
        )
        if size > self.max_bytes:
            return
        self._entries[key] = _Entry(probabilities, text, max_length, size, scope)
        self.size_bytes += size
        while len(self._entries) > self.max_entries or self.size_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.size_bytes -= evicted.size_bytes
        self._show_size()

    def switch_bundle(self, model: str, digest: str) -> list[WarmText]:
        """The bundle with `digest` serves `model` from now on: drop the old bundle's
        entries and return its most hit texts (at most --result-cache-warm, most hit
        first, each with the scope it was hit in) for the new one to compute."""
        self._serving[model] = digest
        if self.enabled:
            # Both outcomes exported from the start, at 0: a `hit` series that appears
            # only at the first hit leaves the hit ratio (and ClassifyResultCacheHitRatioLow)
            # empty while nothing hits at all.
            for outcome in (CACHE_HIT, CACHE_MISS):
                self._metrics.cache_requests.labels(model, outcome)
        dropped = [(key, entry) for key, entry in self._entries.items() if key[0] == model]
        for key, entry in dropped:
            del self._entries[key]
            self.size_bytes -= entry.size_bytes
        self._show_size()
        # Most hit first; among equals, the most recently used.
        recent_first = [entry for _, entry in reversed(dropped) if entry.hits]
        hit = sorted(recent_first, key=lambda entry: -entry.hits)
        return [WarmText(entry.text, entry.max_length, entry.scope) for entry in hit[: self._warm]]

    def _show_size(self) -> None:
        self._metrics.result_cache_entries.set(len(self._entries))
        self._metrics.result_cache_bytes.set(self.size_bytes)


class WarmTextsUnreadable(ModelLoadError):
    """A model's warm_texts file is not UTF-8 text; the message starts with the file."""


def read_warm_texts(path: Path) -> list[WarmText]:
    """The texts of a warm_texts file: one a line, blank lines skipped, at most
    WARM_TEXTS_LIMIT of them, each cut to WARM_TEXT_CHARS (the model truncates far
    sooner), from the whole lines in its first WARM_TEXTS_MAX_BYTES. A file that is
    not UTF-8 is refused as WarmTextsUnreadable, like a bad bundle file: the load
    is refused and the serving version stays."""
    # NOTE: read in one bounded block. Line by line, a file with no line break (or a
    # device that never ends) was read whole into one line before its text was cut.
    with path.open("rb") as stream:
        data = stream.read(WARM_TEXTS_MAX_BYTES + 1)
    if len(data) > WARM_TEXTS_MAX_BYTES:  # whole lines only: the last one may go on
        data = data[: max(data.rfind(b"\n"), data.rfind(b"\r")) + 1]
    texts: list[WarmText] = []
    # Lines as a text file's are (universal newlines), not str.splitlines()'s, which
    # also breaks at form feeds and U+2028; each decoded on its own, so that a bad
    # byte past the last text used is never read, as when the file was read by line.
    for number, line in enumerate(_LINE_BREAK.split(data), start=1):
        try:
            text = line.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise WarmTextsUnreadable(
                f"{path}: warm_texts file is not UTF-8 text (byte {line[exc.start]:#04x} on "
                f"line {number}: {exc.reason})"
            ) from exc
        if text:
            texts.append(WarmText(text[:WARM_TEXT_CHARS], None))
        if len(texts) == WARM_TEXTS_LIMIT:
            break
    return texts
