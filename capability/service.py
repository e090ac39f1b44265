"""Thin servicers: protobuf in, one domain call, protobuf out.

Validation, request IDs, tracing and error statuses are handled around these
methods by classify_common.interceptor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from google.protobuf import duration_pb2, timestamp_pb2
from google.rpc import status_pb2

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc as pb_grpc
from ai.classify.v1 import model_service_pb2 as model_pb
from ai.classify.v1 import model_service_pb2_grpc as model_pb_grpc
from capability.batching import PRIORITY_BATCH, PRIORITY_INTERACTIVE, TextResult
from capability.bundle import LoadedBundle
from capability.item_trace import (
    CallReceipt,
    abandon_item_trace,
    end_item_trace,
    start_item_trace,
)
from capability.lifecycle import ModelLifecycle, RefusedVersion
from capability.memory import MemoryLedger, MemoryReading
from capability.workers import TextRequest, WorkerPool
from capability.workers.admission import CACHE_BYPASS, CACHE_USE
from classify_common.context import (
    CACHE_SCOPE_HEADER,
    EARLY_RESULTS_HEADER,
    EARLY_RESULTS_REQUEST_HEADER,
    LOAD_REPORT_TRAILER,
    current_request,
    is_valid_request_id,
    new_request_id,
)
from classify_common.errors import (
    MethodNotServed,
    ServiceError,
    UnreadableText,
    grpc_code_for,
    is_routine_refusal,
)
from classify_common.intake import current_batch_intake, item_status
from classify_common.nodes import RequestTrace, current_trace
from classify_common.tracing import format_trace_id

Context = grpc.aio.ServicerContext[Any, Any]

log = logging.getLogger(__name__)


class ClassifyServicer(pb_grpc.ClassifyServiceServicer):
    def __init__(self, pool: WorkerPool, default_model: str) -> None:
        self._pool = pool
        self._default_model = default_model

    async def Classify(self, request: pb.ClassifyRequest, context: Context) -> pb.ClassifyResponse:
        ids = current_request()
        assert ids is not None, "the lifecycle interceptor binds every contract call"
        receipt = CallReceipt.of(current_trace())
        remaining = context.time_remaining()
        model = request.model or self._default_model
        deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
        try:
            result = await self._pool.classify(
                model,
                request.text,
                max_length=request.max_length if request.HasField("max_length") else None,
                priority=_priority(request),
                request_id=ids.request_id,
                deadline=deadline,
                cache=_cache_policy(request),
                cache_scope=_cache_scope(context),
            )
        except ServiceError:
            # A refusal carries the load report too: refused for a full queue or a long
            # wait, the orchestrator would otherwise keep the last answer's, which said
            # the replica had room.
            self._report_load(context, model, receipt)
            raise
        self._report_load(context, model, receipt)
        return classify_response(request, result, ids.request_id, ids.trace_id)

    def _report_load(self, context: Context, model: str, receipt: CallReceipt) -> None:
        load = self._pool.load_report(model, receipt.seconds_since())
        context.set_trailing_metadata(((LOAD_REPORT_TRAILER, load),))

    async def ClassifyBatch(
        self, request: pb.ClassifyBatchRequest, context: Context
    ) -> pb.ClassifyBatchResponse:
        ids = current_request()
        assert ids is not None, "the lifecycle interceptor binds every contract call"
        call_trace = current_trace()
        receipt = CallReceipt.of(call_trace)
        remaining = context.time_remaining()
        call_deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
        texts = [
            self._text_of(item, index, request.item_contexts, receipt, call_deadline, call_trace)
            for index, item in enumerate(request.items)
        ]
        if call_trace is not None:
            call_trace.log_fields.update(items=len(texts))
        answered_early: set[int] = set()
        try:
            outcomes = await self._pool.classify_many(
                texts, _early_answer(context, request, texts, ids.trace_id, answered_early)
            )
        except BaseException as error:
            for index, text in enumerate(texts):
                if index not in answered_early:
                    abandon_item_trace(text.trace)
            if isinstance(error, ServiceError):
                self._report_load(context, texts[0].model, receipt)
            raise
        # One report, for the first item's model: the orchestrator's coalesced calls
        # carry one model each.
        self._report_load(context, texts[0].model, receipt)
        answer = pb.ClassifyBatchResponse()
        failed = 0
        for index, (item, text, outcome) in enumerate(
            zip(request.items, texts, outcomes, strict=True)
        ):
            if isinstance(outcome, ServiceError):
                failed += 1
                _log_failed_item(text, outcome, ids.request_id)
            _fill_batch_result(
                answer.results.add(),
                item,
                text,
                outcome,
                ids.trace_id,
                index,
                end_trace=index not in answered_early,
            )
        if call_trace is not None:
            call_trace.log_fields["items_failed"] = failed
            call_trace.log_fields.update(_one_replica_of(texts))
        return answer

    def _text_of(
        self,
        item: pb.ClassifyRequest,
        index: int,
        contexts: Sequence[pb.ItemContext],
        receipt: CallReceipt,
        call_deadline: float | None,
        call_trace: RequestTrace | None,
    ) -> TextRequest:
        """Batch item `index` as a domain value, with its own request ID, deadline and
        trace, and its refusal at intake if it had one."""
        item_context = contexts[index] if contexts else None
        request_id = item.request_id if is_valid_request_id(item.request_id) else new_request_id()
        refusal = current_batch_intake().refused.get(index)
        return TextRequest(
            model=item.model or self._default_model,
            text=item.text,
            max_length=item.max_length if item.HasField("max_length") else None,
            priority=_priority(item),
            request_id=request_id,
            deadline=_item_deadline(item_context, receipt, call_deadline),
            trace=start_item_trace(
                call_trace,
                receipt,
                index=index,
                request_id=request_id,
                traceparent=item_context.traceparent if item_context else "",
                refusal=refusal,
            ),
            refusal=refusal,
            cache=_cache_policy(item),
            cache_scope=item_context.cache_scope if item_context else "",
        )

    async def GetResult(
        self, request: pb.GetResultRequest, context: Context
    ) -> pb.ClassifyResponse:
        # Results that outlive a time budget are kept by the orchestrator, not here.
        raise MethodNotServed(
            "GetResult is served by the orchestrator; capability servers keep no results",
            request_id=request.request_id,
        )


def _cache_policy(request: pb.ClassifyRequest) -> str:
    return CACHE_BYPASS if request.cache == pb.CACHE_POLICY_BYPASS else CACHE_USE


def _cache_scope(context: Context) -> str:
    """The result-cache scope a Classify call carries (CACHE_SCOPE_HEADER; "" when
    none). Trusted as it is: with an internal token configured only the orchestrator,
    which sets it from the caller's tenant, gets this far (capability.security)."""
    scope = ""
    for key, value in context.invocation_metadata() or ():
        if key == CACHE_SCOPE_HEADER and isinstance(value, str):
            scope = value
    return scope


def _priority(request: pb.ClassifyRequest) -> int:
    return PRIORITY_BATCH if request.priority == pb.PRIORITY_BATCH else PRIORITY_INTERACTIVE


def _item_deadline(
    item_context: pb.ItemContext | None, receipt: CallReceipt, call_deadline: float | None
) -> float | None:
    """The earlier of the call's deadline and the item's own (its timeout counts from
    when the call arrived), in event-loop time."""
    if item_context is None or not item_context.HasField("timeout"):
        return call_deadline
    own = receipt.loop_time + item_context.timeout.ToNanoseconds() / 1e9
    return own if call_deadline is None else min(own, call_deadline)


def classify_response(
    request: pb.ClassifyRequest, result: TextResult, request_id: str, trace_id: str
) -> pb.ClassifyResponse:
    """The answer to one text: its labels best first (top_k of them), and its IDs."""
    response = pb.ClassifyResponse()
    _fill_response(response, request, result, request_id, trace_id)
    return response


def _fill_response(
    response: pb.ClassifyResponse,
    request: pb.ClassifyRequest,
    result: TextResult,
    request_id: str,
    trace_id: str,
) -> None:
    """Write classify_response's answer into `response`, an empty message.

    NOTE: filled in place, field by field. A message passed to a constructor (a
    Label in `labels=[...]`, a response in a ClassifyBatchResult) is copied into
    it: building a batch's answer that way took 24 µs an item against 13.5 in
    place (64 items of four labels, scratch timing, 2026-12-03).
    """
    names = (label.name for label in result.bundle.classifier.labels)
    ranked = sorted(zip(names, result.probabilities, strict=True), key=lambda p: p[1], reverse=True)
    if request.HasField("top_k"):
        ranked = ranked[: request.top_k]
    labels = response.labels
    for name, score in ranked:
        labels.add(name=name, score=score)
    response.confidence = ranked[0][1]
    response.model.name = result.bundle.name
    response.model.version = result.bundle.version
    response.request_id = request_id
    response.trace_id = trace_id
    response.status = pb.RESULT_STATUS_DONE
    response.cached = result.cached
    response.truncated = result.truncated


def _early_answer(
    context: Context,
    request: pb.ClassifyBatchRequest,
    texts: Sequence[TextRequest],
    call_trace_id: str,
    answered: set[int],
) -> Callable[[dict[int, ServiceError]], Awaitable[None]] | None:
    """What answers a batch's refused items while others are still to be computed
    (WorkerPool.classify_many says which, and when), when the caller asked for early
    results (EARLY_RESULTS_REQUEST_HEADER): they go at once in the answer's initial
    metadata, as many as fit in the bytes it takes, in order; the indexes sent are
    added to `answered`, whose traces end then. Without the ask, None.

    A refused item's caller (the orchestrator) can then answer it, or fall back, when
    it is refused instead of when the call's last batch is computed: under overload,
    the capability's DEADLINE_UNREACHABLE answers had come back after 250 ms at p50."""
    max_bytes = 0
    for key, value in context.invocation_metadata() or ():
        if key == EARLY_RESULTS_REQUEST_HEADER and isinstance(value, str) and value.isdigit():
            max_bytes = int(value)
    if max_bytes == 0:
        return None

    async def answer(refused: dict[int, ServiceError]) -> None:
        early = pb.ClassifyBatchResponse(results=[pb.ClassifyBatchResult() for _ in texts])
        size = early.ByteSize()
        sent = []
        for index, error in sorted(refused.items()):
            status = _item_error(texts[index], error, call_trace_id, index)
            # The result's bytes and its length prefix, which grows with it.
            size += status.ByteSize() + 4
            if size > max_bytes:
                break
            early.results[index].error.CopyFrom(status)
            sent.append(index)
        if not sent:
            return
        await context.send_initial_metadata(((EARLY_RESULTS_HEADER, early.SerializeToString()),))
        for index in sent:
            end_item_trace(texts[index].trace, refused[index])
            answered.add(index)

    return answer


def _log_failed_item(text: TextRequest, error: ServiceError, call_request_id: str) -> None:
    """A line for a batch item that failed, under the item's own request ID (and trace
    ID, when it has a trace of its own), naming the call it came in. The call's `rpc`
    line names only the call, which the orchestrator merged from many requests: a
    failure of one of them, logged as a single Classify's would be, must be found by
    that request's ID. Items answered are not logged one by one, nor, but at DEBUG,
    items refused for their text or for load (is_routine_refusal): the orchestrator's
    line for the request says those, and the metrics count them."""
    fields: dict[str, object] = {
        # The model, version and worker it was admitted to (admit_group): the runbook
        # looks for one failing worker in these lines.
        **(text.trace.log_fields if text.trace is not None else {}),
        "request_id": text.request_id,
        "code": grpc_code_for(error).name,
        "reason": error.reason,
        "error": error.message,
        "call_request_id": call_request_id,
    }
    if text.trace is not None:
        fields["trace_id"] = format_trace_id(text.trace.server_span)
    level = logging.DEBUG if is_routine_refusal(error) else logging.WARNING
    log.log(level, "batch item failed", extra=fields)


def _one_replica_of(texts: Sequence[TextRequest]) -> dict[str, object]:
    """`model`, `model_version` and `worker` for a batch call's `rpc` line, where every
    item that reached a replica reached the same one (as the orchestrator's merged
    calls do); nothing where they went to several, or none did."""
    replica: tuple[object, object, object] | None = None
    for text in texts:
        if text.trace is None:
            continue
        fields = text.trace.log_fields
        worker = fields.get("worker")
        if worker is None:
            continue  # refused before it reached a replica
        this = (fields["model"], fields["model_version"], worker)
        if replica is None:
            replica = this
        elif this != replica:
            return {}
    if replica is None:
        return {}
    return dict(zip(("model", "model_version", "worker"), replica, strict=True))


def _item_trace_id(text: TextRequest, call_trace_id: str) -> str:
    """The item's own trace ID; the call's when the item has no trace."""
    return format_trace_id(text.trace.server_span) if text.trace else call_trace_id


def _item_error(
    text: TextRequest, error: ServiceError, call_trace_id: str, index: int
) -> status_pb2.Status:
    """The google.rpc.Status of the refused item `index`, under its own request and
    trace IDs. The model's refusal of its text names the item's field (`items[3].text`),
    as the contract's refusals of an item do."""
    if isinstance(error, UnreadableText):
        error = error.within(f"items[{index}]")
    return item_status(error, text.request_id, _item_trace_id(text, call_trace_id))


def _fill_batch_result(
    result: pb.ClassifyBatchResult,
    item: pb.ClassifyRequest,
    text: TextRequest,
    outcome: TextResult | ServiceError,
    call_trace_id: str,
    index: int,
    *,
    end_trace: bool,
) -> None:
    """Write the result of item `index` into `result`, under the item's own request and
    trace IDs; with `end_trace`, its trace ends here."""
    if isinstance(outcome, ServiceError):
        if end_trace:
            end_item_trace(text.trace, outcome)
        result.error.CopyFrom(_item_error(text, outcome, call_trace_id, index))
        return
    end_item_trace(text.trace, None)
    _fill_response(
        result.response, item, outcome, text.request_id, _item_trace_id(text, call_trace_id)
    )


async def describe(
    bundle: LoadedBundle, pool: WorkerPool, lifecycle: ModelLifecycle
) -> model_pb.ModelInfo:
    loaded_at = timestamp_pb2.Timestamp()
    loaded_at.FromDatetime(pool.live_since(bundle.name))
    load_duration = duration_pb2.Duration()
    load_duration.FromNanoseconds(int(pool.load_seconds(bundle.name) * 1e9))
    classifier = bundle.classifier
    return model_pb.ModelInfo(
        name=bundle.name,
        version=bundle.version,
        state=model_pb.MODEL_STATE_READY,
        labels=[
            model_pb.ModelLabel(name=label.name, description=label.description)
            for label in classifier.labels
        ],
        max_sequence_length=classifier.max_seq_length,
        devices=[worker.name for worker in pool.workers],
        source=str(bundle.directory),
        loaded_at=loaded_at,
        load_duration=load_duration,
        precision=bundle.precision,
        memory_bytes=bundle.memory_bytes,
        digest=bundle.digest,
        architecture=bundle.architecture,
        memory=[
            _worker_memory(worker, ledger, budget, resident)
            for worker, ledger, budget, resident in pool.ledgers(bundle.name)
        ],
        residency=pool.residency(bundle.name),
        pinned_version=lifecycle.pinned(bundle.name) or "",
        refused_versions=[
            _refused_version(version, refused)
            for version, refused in await lifecycle.refusals(bundle.name)
        ],
    )


def _refused_version(version: str, refused: RefusedVersion) -> model_pb.RefusedVersion:
    refused_at = timestamp_pb2.Timestamp()
    refused_at.FromDatetime(refused.refused_at)
    return model_pb.RefusedVersion(version=version, reason=refused.reason, refused_at=refused_at)


def _reading(reading: MemoryReading) -> model_pb.MemoryReading:
    return model_pb.MemoryReading(
        allocated_bytes=reading.allocated_bytes, reserved_bytes=reading.reserved_bytes
    )


def _worker_memory(
    worker: str, ledger: MemoryLedger, budget: int, resident: bool
) -> model_pb.WorkerMemory:
    """One ledger entry as the contract carries it."""
    return model_pb.WorkerMemory(
        worker=worker,
        source=ledger.source,
        weights_bytes=ledger.weights_bytes,
        predicted_bytes=ledger.predicted_bytes,
        load_stages=[
            model_pb.LoadStageMemory(
                stage=stage.stage, before=_reading(stage.before), after=_reading(stage.after)
            )
            for stage in ledger.stages
        ],
        after_warm_up=_reading(ledger.after_warm_up),
        warm_up_peak_bytes=ledger.warm_up_peak_bytes,
        warm_up_batch_size=ledger.warm_up_batch_size,
        warm_up_tokens=ledger.warm_up_tokens,
        footprint_bytes=ledger.footprint_bytes,
        budget_bytes=budget,
        resident=resident,
    )


class ModelServicer(model_pb_grpc.ModelServiceServicer):
    def __init__(self, pool: WorkerPool, lifecycle: ModelLifecycle) -> None:
        self._pool = pool
        self._lifecycle = lifecycle

    async def ListModels(
        self, request: model_pb.ListModelsRequest, context: Context
    ) -> model_pb.ListModelsResponse:
        return model_pb.ListModelsResponse(
            models=[
                await describe(bundle, self._pool, self._lifecycle)
                for bundle in self._pool.models().values()
            ]
        )

    async def GetModel(
        self, request: model_pb.GetModelRequest, context: Context
    ) -> model_pb.GetModelResponse:
        if self._lifecycle.loading(request.name):
            # Held here, no version serving yet: the contract's LOADING, name and state only.
            return model_pb.GetModelResponse(
                model=model_pb.ModelInfo(name=request.name, state=model_pb.MODEL_STATE_LOADING)
            )
        return model_pb.GetModelResponse(
            model=await describe(self._pool.serving(request.name), self._pool, self._lifecycle)
        )

    async def ReloadModel(
        self, request: model_pb.ReloadModelRequest, context: Context
    ) -> model_pb.ReloadModelResponse:
        bundle, previous = await self._lifecycle.reload(request.name, request.version or None)
        return model_pb.ReloadModelResponse(
            model=await describe(bundle, self._pool, self._lifecycle), previous_version=previous
        )
