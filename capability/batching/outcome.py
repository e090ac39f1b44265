"""What a batch's forward gives back, and the trace it leaves.

`BatchOutcome` is what the device thread returns to the batching loop for one
forward; `TextResult` is what each text's waiter gets; `trace_batch` records the
batch's device nodes (by its StageMarks) for every traced request in it.
"""

from __future__ import annotations

from asyncio import Future
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import INVALID_SPAN, Link

from capability.batching.queue import PendingRequest
from capability.bundle import LoadedBundle
from capability.model import EncodedText
from capability.model.stages import StageMarks
from classify_common.nodes import (
    BATCH_ASSEMBLE,
    BATCH_SPAN_NAME,
    CLASSIFY_BATCH_SIZE,
    CLASSIFY_BUCKET,
    CLASSIFY_CLOCK,
    CLASSIFY_MODEL,
    CLASSIFY_MODEL_VERSION,
    CLASSIFY_PADDING_RATIO,
    CLASSIFY_WORKER,
    CUDA_LAUNCH,
    GPU_QUEUE_WAIT,
    H2D_COPY,
    POSTPROCESS,
    emit_node,
)
from classify_common.tracing import get_tracer


@dataclass(frozen=True)
class TextResult:
    """One text's label probabilities and the exact model version that computed them."""

    probabilities: tuple[float, ...]
    bundle: LoadedBundle
    token_count: int
    truncated: bool
    # Answered from the result cache (capability/result_cache.py), not computed now.
    cached: bool = False


@dataclass(frozen=True)
class BatchOutcome:
    """What one forward on the device thread returns to the loop."""

    probabilities: list[list[float]]  # (B, L), columns follow the classifier's labels
    finite_rows: tuple[bool, ...]
    padded_tokens: int
    seconds: float
    # When each stage of the forward began and ended (None: not marked), and by which clock.
    marks: StageMarks | None
    clock: str
    # Per submitted text: whether its deadline had passed, so it was left out. The
    # other fields describe the texts that were computed, in order.
    expired: tuple[bool, ...] = ()
    # Per submitted text: whether its deadline would pass before the forward could
    # end (the time left was shorter than `predicted_seconds`, the forward's predicted
    # time when it started at `started_at`, monotonic), so it was left out too.
    unreachable: tuple[bool, ...] = ()
    predicted_seconds: float = 0.0
    started_at: float = 0.0
    # Per submitted text: whether its caller had gone (its future cancelled: a hedged
    # call's loser, a client's cancel), so it was left out, with nobody to answer.
    gone: tuple[bool, ...] = ()

    def left_out(self, index: int) -> bool:
        """Whether the `index`-th submitted text was not computed."""
        return (
            (bool(self.expired) and self.expired[index])
            or (bool(self.unreachable) and self.unreachable[index])
            or (bool(self.gone) and self.gone[index])
        )


# Called on the device thread before a forward that leaves some of its texts out, with
# an outcome that says which (nothing computed in it), so that their callers are
# answered then, not when the forward ends.
LeftOut = Callable[[BatchOutcome], None]

# Runs on the device thread: the texts of a batch, their deadlines (event-loop time) and
# their callers' futures (read for cancellation only) in, one forward's outcome out;
# LeftOut told first of the texts left out.
Compute = Callable[
    [list[EncodedText], list[float | None], LeftOut | None, Sequence[Future[Any]] | None],
    BatchOutcome,
]


def padding_ratio(batch: Sequence[PendingRequest[TextResult]], outcome: BatchOutcome) -> float:
    """Share of the batch's token positions that are padding."""
    real_tokens = sum(len(request.encoded) for request in batch)
    return 1.0 - real_tokens / (len(batch) * outcome.padded_tokens)


def trace_batch(
    batch: list[PendingRequest[TextResult]],
    outcome: BatchOutcome,
    bundle: LoadedBundle,
    worker_name: str,
) -> None:
    """The batch's device nodes for every traced request in it, and the batch's own
    span, which each request's `batch_assemble` links to (and it links back)."""
    traced = [(request, request.trace) for request in batch if request.trace is not None]
    marks = outcome.marks
    if not traced or marks is None:
        return
    started, done = marks.started, marks.done
    model_name, version = bundle.name, bundle.version
    batch_attributes = {
        CLASSIFY_BATCH_SIZE: len(batch),
        CLASSIFY_BUCKET: batch[0].bucket,
        CLASSIFY_PADDING_RATIO: round(padding_ratio(batch, outcome), 4),
    }
    spanned = [trace for _, trace in traced if trace.makes_spans]
    batch_span = (
        get_tracer().start_span(
            BATCH_SPAN_NAME,
            start_time=started,
            attributes={
                **batch_attributes,
                CLASSIFY_WORKER: worker_name,
                CLASSIFY_MODEL: model_name,
                CLASSIFY_MODEL_VERSION: version,
                CLASSIFY_CLOCK: outcome.clock,
            },
            links=[Link(trace.server_span.get_span_context()) for trace in spanned],
        )
        if spanned
        else INVALID_SPAN
    )
    to_batch = [Link(batch_span.get_span_context())]
    clock = {CLASSIFY_CLOCK: outcome.clock}
    worker = {CLASSIFY_WORKER: worker_name}
    model = {CLASSIFY_MODEL: model_name, CLASSIFY_MODEL_VERSION: version}
    for request, trace in traced:
        emit_node(trace, GPU_QUEUE_WAIT, request.admitted_ns, started, worker)
        emit_node(trace, BATCH_ASSEMBLE, started, marks.assembled, batch_attributes, to_batch)
        emit_node(trace, H2D_COPY, marks.assembled, marks.copied, clock)
        emit_node(trace, CUDA_LAUNCH, marks.copied, marks.forwarded, {**clock, **model})
        emit_node(trace, POSTPROCESS, marks.forwarded, done, clock)
        # The model, version and worker are there since admission (Admitter.admit_group).
        trace.log_fields.update(batch_size=len(batch), tokens=len(request.encoded))
    batch_span.end(end_time=done)
