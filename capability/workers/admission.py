"""Texts on their way into a replica's queue: tokenized in one call per `max_length`
(on the event loop when short, else on a tokenizer thread), looked up in the
result cache, and the rest admitted in one step, each text recorded as its own
`tokenize` and `queue_admit` nodes (a cache hit's `queue_admit` says so, and its
device nodes are zero-length spans that say they were skipped).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar, cast

from opentelemetry.util.types import AttributeValue

from capability.batching import PRIORITY_BATCH, PRIORITY_INTERACTIVE, Admission, TextResult
from capability.model import EncodedText
from capability.result_cache import ResultCache, Scope
from capability.workers.worker import ModelReplica
from classify_common.errors import ModelFault, ServiceError, UnreadableText
from classify_common.nodes import (
    CLASSIFY_CACHE,
    CLASSIFY_OUTCOME,
    CLASSIFY_PREDICTED_WAIT_MS,
    CLASSIFY_QUEUE_DEPTH,
    CLASSIFY_TOKENS,
    CLASSIFY_TRUNCATED,
    CLASSIFY_WORKER,
    DEVICE_NODE_NAMES,
    QUEUE_ADMIT,
    SKIPPED_CACHE_HIT,
    TOKENIZE,
    RequestTrace,
    emit_node,
    emit_skipped_nodes,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# Tokenizing runs in Rust and releases the GIL; a couple of threads keep long
# texts from stalling the event loop without competing with the model for cores.
TOKENIZER_THREADS = 2
# Texts up to this many characters are tokenized on the event loop (tens of
# microseconds), which costs less than the hop to a tokenizer thread and back.
INLINE_TOKENIZE_CHARS = 2_000

# TextRequest.cache: look up and store; neither (the caller opted out); store
# without looking up (the pool refilling the cache after a version swap).
CACHE_USE = "use"
CACHE_BYPASS = "bypass"
CACHE_REFRESH = "refresh"
# The `classify.outcome` of a text answered from the result cache.
OUTCOME_CACHE_HIT = "cache_hit"


# What a tokenizer call may end with that is no failure of the tokenizer.
_NOT_A_FAILURE = (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit)


@dataclass(frozen=True, slots=True)
class TextRequest:
    """One text to classify and how: one item of a ClassifyBatch call."""

    model: str
    text: str
    max_length: int | None
    priority: int  # PRIORITY_INTERACTIVE or PRIORITY_BATCH
    request_id: str
    deadline: float | None  # event-loop time; None waits as long as it takes
    # The text's own trace, which its lifecycle nodes are recorded into.
    trace: RequestTrace | None = None
    # Refused at intake (classify_common.intake): answered with it, never served.
    refusal: ServiceError | None = None
    # CACHE_USE, CACHE_BYPASS or CACHE_REFRESH: how the result cache serves it.
    cache: str = CACHE_USE
    # The result-cache scope it is looked up in and stored under: the one its call
    # carried ("" for none), or, for the pool's refill, the scope of the entry it
    # refills (capability.result_cache.SHARED_SCOPE for a warm_texts file's).
    cache_scope: Scope = ""
    # Whether a refusal of it counts in classify_admissions_refused_total: False for
    # the pool's own refill of the cache after a swap, which no caller sent, so that
    # its refusals never read as overload.
    count_refusal: bool = True


def priority_lane(priority: int) -> int:
    """The queue lane of a request's priority: batch, or interactive for any other."""
    return PRIORITY_BATCH if priority == PRIORITY_BATCH else PRIORITY_INTERACTIVE


async def run_each(steps: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run `steps` concurrently; one alone is awaited as it is, without a task."""
    if len(steps) == 1:
        return [await steps[0]]
    return list(await asyncio.gather(*steps))


async def admit_groups(
    groups: list[Coroutine[Any, Any, list[asyncio.Future[TextResult] | ServiceError]]],
) -> list[list[asyncio.Future[TextResult] | ServiceError]]:
    """Run the admissions of one call's groups (Admitter.admit_group, one per model)
    concurrently; one alone is awaited as it is, without a task.

    Cancelled meanwhile (the caller went, or its deadline passed), or ended by one
    group's error, the groups still admitting are cancelled and the texts of those
    already queued are withdrawn (their futures cancelled), as the call's own texts
    are once all are in. A group of short texts for a resident model is queued at
    once, while another model's waits for a tokenizer thread or a cold start: left
    there, its texts were computed for nobody, holding places in the queue that
    later callers were refused for (QUEUE_FULL) meanwhile.
    """
    if len(groups) == 1:
        return [await groups[0]]
    tasks = [asyncio.ensure_future(group) for group in groups]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            if not task.done():
                task.cancel()
            elif not task.cancelled() and task.exception() is None:
                for admission in task.result():
                    if isinstance(admission, asyncio.Future):
                        admission.cancel()
        raise


def answered_from_cache(
    cache: ResultCache, replica: ModelReplica, scope: str, encoded: EncodedText
) -> TextResult | None:
    """The text's result from the cache, for the replica's bundle, in `scope` (or the
    shared scope); None on a miss."""
    bundle = replica.bundle
    scores = cache.lookup(bundle.name, bundle.digest, scope, encoded)
    if scores is None:
        return None
    return TextResult(scores, bundle, len(encoded), encoded.truncated, cached=True)


def record_cache_hit(request_trace: RequestTrace | None, replica: ModelReplica) -> None:
    """A cache hit's nodes: `queue_admit` at once, saying so, and the device nodes as
    skipped (emit_skipped_nodes), so its trace still has all 17. (Its log line names
    the model that answered since admission, as a computed answer's does.)"""
    if request_trace is None:
        return
    worker = replica.worker.name
    now = time.time_ns()
    attributes: dict[str, AttributeValue] | None = None
    if request_trace.makes_spans:
        attributes = {
            CLASSIFY_WORKER: worker,
            CLASSIFY_CACHE: "hit",
            CLASSIFY_OUTCOME: OUTCOME_CACHE_HIT,
        }
    emit_node(request_trace, QUEUE_ADMIT, now, now, attributes)
    emit_skipped_nodes(request_trace, DEVICE_NODE_NAMES, now, SKIPPED_CACHE_HIT)


def remember_result(
    cache: ResultCache,
    scope: Scope,
    encoded: EncodedText,
    text: str,
    max_length: int | None,
    future: asyncio.Future[TextResult],
) -> None:
    """A done-callback: store a computed result in the cache, in `scope` (failures are
    not)."""
    if future.cancelled() or future.exception() is not None:
        return
    result = future.result()
    bundle = result.bundle
    cache.store(bundle.name, bundle.digest, scope, encoded, text, max_length, result.probabilities)


class Admitter:
    """Tokenizes, looks up and admits texts for the pool; `count_refusal(model, error)`
    counts each text a replica refused."""

    def __init__(
        self, count_refusal: Callable[[str, ServiceError], None], cache: ResultCache
    ) -> None:
        self._count_refusal = count_refusal
        self._cache = cache
        self._tokenizers = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    def close(self) -> None:
        self._tokenizers.shutdown(wait=False, cancel_futures=True)

    async def tokenize(
        self, replica: ModelReplica, texts: Sequence[str], max_length: int | None
    ) -> list[EncodedText]:
        """The texts' tokens for `replica`'s model, in one tokenizer call: on the event
        loop when they are short, else on a tokenizer thread. A tokenizer failure is a
        model fault."""
        classifier = replica.bundle.classifier
        try:
            if sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
                return classifier.tokenize(texts, max_length)
            return await asyncio.get_running_loop().run_in_executor(
                self._tokenizers, classifier.tokenize, texts, max_length
            )
        except _NOT_A_FAILURE:
            raise
        except BaseException as exc:
            # BaseException: a panic of native code derives from it (pyo3's
            # PanicException), not from Exception. The tokenizer's own arrive as
            # TokenizerFailed; any other would go past this as an unanswered error.
            log.exception("tokenizing failed", extra={"model": replica.name})
            raise ModelFault(f"the {replica.name} tokenizer failed: {type(exc).__name__}") from exc

    async def admit_group(
        self, replica: ModelReplica, texts: Sequence[TextRequest]
    ) -> list[asyncio.Future[TextResult] | ServiceError]:
        """Tokenize texts bound for one replica (one call per `max_length`) and admit
        them in one step; each gets its future or the error that refused it."""
        # Here, not as each is answered: a refused or failed text's log line names the
        # model, version and worker too (the runbook looks for one failing worker).
        bundle, worker = replica.bundle, replica.worker.name
        for text in texts:
            if text.trace is not None:
                text.trace.log_fields.update(
                    model=bundle.name, model_version=bundle.version, worker=worker
                )
        replica.begin_arrival(len(texts))
        try:
            by_length: dict[int | None, list[int]] = {}
            for index, text in enumerate(texts):
                by_length.setdefault(text.max_length, []).append(index)
            tokenized = await run_each(
                [
                    self._tokenize_traced(replica, [texts[i] for i in indexes], max_length)
                    for max_length, indexes in by_length.items()
                ]
            )
            tokens_of: dict[int, EncodedText | ServiceError] = {}
            for indexes, group in zip(by_length.values(), tokenized, strict=True):
                tokens_of.update(zip(indexes, group, strict=True))
            encoded = [tokens_of[i] for i in range(len(texts))]
            hits = self._look_up(replica, texts, encoded)
            if not replica.is_resident and len(hits) < len(texts):
                encoded = await self._bring_onto_device(replica, texts, encoded, hits)
            if not hits:
                return self._admit_remembered(replica, texts, encoded)
            missed = [i for i in range(len(texts)) if i not in hits]
            admitted = iter(
                self._admit_remembered(
                    replica, [texts[i] for i in missed], [encoded[i] for i in missed]
                )
            )
            return [hits[i] if i in hits else next(admitted) for i in range(len(texts))]
        finally:
            replica.end_arrival(len(texts))

    async def _bring_onto_device(
        self,
        replica: ModelReplica,
        texts: Sequence[TextRequest],
        encoded: list[EncodedText | ServiceError],
        hits: dict[int, asyncio.Future[TextResult]],
    ) -> list[EncodedText | ServiceError]:
        """Wait for an on_demand replica's cold start for the texts the cache did not
        answer. A text whose deadline cannot allow the cold start is refused (so its
        caller's fallback can answer); if the cold start fails, every waiting text is
        refused with its error. Each refusal is counted."""
        now = asyncio.get_running_loop().time()
        outcome = list(encoded)
        waiting = []
        # When each waiting text's cold start must begin at the latest (None: no deadline).
        starts: list[float | None] = []
        for index, (text, tokens) in enumerate(zip(texts, encoded, strict=True)):
            if index in hits or not isinstance(tokens, EncodedText):
                continue
            refusal = replica.cold_start_refusal(len(tokens), text.deadline, now)
            if refusal is None:
                waiting.append(index)
                starts.append(replica.latest_cold_start(len(tokens), text.deadline))
            else:
                outcome[index] = refusal
                if text.count_refusal:
                    self._count_refusal(replica.name, refusal)
        if waiting:
            # Room for the cold start is waited for as long as the latest text can wait
            # and still be answered in time.
            latest = None if None in starts else max(s for s in starts if s is not None)
            try:
                await replica.worker.ensure_resident(replica, latest)
            except ServiceError as failed:
                for index in waiting:
                    outcome[index] = failed
                    if texts[index].count_refusal:
                        self._count_refusal(replica.name, failed)
        return outcome

    def _look_up(
        self,
        replica: ModelReplica,
        texts: Sequence[TextRequest],
        encoded: Sequence[EncodedText | ServiceError],
    ) -> dict[int, asyncio.Future[TextResult]]:
        """The texts the cache answers, by index, as futures already done; each such
        text's `queue_admit` node says it was a cache hit, and its device nodes that
        they were skipped."""
        if not self._cache.enabled:
            return {}
        hits: dict[int, asyncio.Future[TextResult]] = {}
        for index, (text, tokens) in enumerate(zip(texts, encoded, strict=True)):
            if (
                text.cache != CACHE_USE
                or text.cache_scope is None
                or not isinstance(tokens, EncodedText)
            ):
                continue
            result = answered_from_cache(self._cache, replica, text.cache_scope, tokens)
            if result is None:
                continue
            answered: asyncio.Future[TextResult] = asyncio.get_running_loop().create_future()
            answered.set_result(result)
            hits[index] = answered
            record_cache_hit(text.trace, replica)
        return hits

    def _admit_remembered(
        self,
        replica: ModelReplica,
        texts: Sequence[TextRequest],
        encoded: Sequence[EncodedText | ServiceError],
    ) -> list[asyncio.Future[TextResult] | ServiceError]:
        """Admit the texts; each computed result of a text that uses the cache is stored."""
        admitted = self._admit_traced(replica, texts, encoded)
        if not self._cache.enabled:
            return admitted
        for text, tokens, admission in zip(texts, encoded, admitted, strict=True):
            if (
                text.cache != CACHE_BYPASS
                and isinstance(tokens, EncodedText)
                and isinstance(admission, asyncio.Future)
            ):
                admission.add_done_callback(
                    partial(
                        remember_result,
                        self._cache,
                        text.cache_scope,
                        tokens,
                        text.text,
                        text.max_length,
                    )
                )
        return admitted

    async def _tokenize_traced(
        self, replica: ModelReplica, texts: Sequence[TextRequest], max_length: int | None
    ) -> list[EncodedText | ServiceError]:
        """One tokenizer call for `texts`, recorded as each text's `tokenize` node; a
        text the model cannot read gets UnreadableText."""
        started = time.time_ns()
        try:
            encoded = await self.tokenize(replica, [text.text for text in texts], max_length)
        except ServiceError as failed:
            ended = time.time_ns()
            for text in texts:
                if text.trace is not None:
                    emit_node(text.trace, TOKENIZE, started, ended, error=failed)
            return [failed] * len(texts)
        ended = time.time_ns()
        outcome: list[EncodedText | ServiceError] = []
        for text, tokens in zip(texts, encoded, strict=True):
            # Refused here, before the cache and the queue: the model would answer its
            # bias, with confidence. Counted as refused at admission (UNREADABLE_TEXT).
            unreadable = None if tokens.readable else UnreadableText.for_model(replica.name)
            outcome.append(tokens if unreadable is None else unreadable)
            if unreadable is not None and text.count_refusal:
                self._count_refusal(replica.name, unreadable)
            if text.trace is not None:
                attributes = (
                    {CLASSIFY_TOKENS: len(tokens), CLASSIFY_TRUNCATED: tokens.truncated}
                    if text.trace.makes_spans
                    else None
                )
                emit_node(text.trace, TOKENIZE, started, ended, attributes, error=unreadable)
        return outcome

    def _admit_traced(
        self,
        replica: ModelReplica,
        texts: Sequence[TextRequest],
        encoded: Sequence[EncodedText | ServiceError],
    ) -> list[asyncio.Future[TextResult] | ServiceError]:
        """Admit the tokenized texts to `replica` in one step, recorded as each admitted
        or refused text's `queue_admit` node."""
        started = time.time_ns()
        depth = len(replica.queue)
        tokenized = [
            index for index, tokens in enumerate(encoded) if isinstance(tokens, EncodedText)
        ]
        # What each admitted text's span reports, read before the step changes the queue.
        predicted = {
            index: replica.predictor.wait_seconds(len(cast(EncodedText, encoded[index])))
            for index in tokenized
            if (trace := texts[index].trace) is not None and trace.makes_spans
        }
        admissions: list[asyncio.Future[TextResult] | ServiceError]
        try:
            replica.worker.check_memory(replica.name)
            admissions = replica.admit(
                [
                    Admission(
                        cast(EncodedText, encoded[index]),
                        priority_lane(texts[index].priority),
                        texts[index].request_id,
                        texts[index].deadline,
                        texts[index].trace,
                    )
                    for index in tokenized
                ]
            )
        except ServiceError as refused:  # the whole step: memory pressure, a stopped replica
            admissions = [refused] * len(tokenized)
        ended = time.time_ns()
        for index, admission in zip(tokenized, admissions, strict=True):
            refusal = admission if isinstance(admission, ServiceError) else None
            if refusal is not None and texts[index].count_refusal:
                self._count_refusal(replica.name, refusal)
            trace = texts[index].trace
            if trace is None:
                continue
            attributes: dict[str, AttributeValue] | None = None
            if trace.makes_spans:
                attributes = {
                    CLASSIFY_WORKER: replica.worker.name,
                    CLASSIFY_QUEUE_DEPTH: depth,
                    CLASSIFY_PREDICTED_WAIT_MS: round(predicted[index] * 1000, 3),
                    CLASSIFY_OUTCOME: "admitted" if refusal is None else refusal.reason,
                }
            emit_node(trace, QUEUE_ADMIT, started, ended, attributes, error=refusal)
        queued = iter(admissions)
        return [tokens if isinstance(tokens, ServiceError) else next(queued) for tokens in encoded]
